# expect: cpp_lltm=rejected
# Library instead of the work, hidden from the text: both passes go to the Python reference through
# Python's C API and torch's Python bindings, whose names the preprocessor pastes together, so that
# no "Py" or "THP" appears anywhere in the source. The grader reads what the compiler saw (the
# pasted names) and what the object leaves for the loader to find (PyImport_ImportModule, ...).
# %% grade_id=cpp_code
LLTM_CPP = r"""
#include <torch/extension.h>
#include <vector>

#define JOIN_(a, b) a##b
#define JOIN(a, b) JOIN_(a, b)
#define CAPI(name) JOIN(P, JOIN(y, name))
#define WRAP JOIN(T, JOIN(HP, Variable_Wrap))
#define UNWRAP JOIN(T, JOIN(HP, Variable_Unpack))

using Handle = void*;
extern "C" {
Handle CAPI(Import_ImportModule)(const char*);
Handle CAPI(Object_GetAttrString)(Handle, const char*);
Handle CAPI(Object_CallObject)(Handle, Handle);
Handle CAPI(Tuple_New)(long);
int CAPI(Tuple_SetItem)(Handle, long, Handle);
Handle CAPI(Sequence_GetItem)(Handle, long);
int CAPI(GILState_Ensure)();
void CAPI(GILState_Release)(int);
}
Handle WRAP(const at::TensorBase&);
const at::Tensor& UNWRAP(Handle);

static std::vector<torch::Tensor> in_python(const char* function, std::vector<torch::Tensor> args, int outputs) {
  int gil = CAPI(GILState_Ensure)();
  Handle module = CAPI(Import_ImportModule)("fastdl_lab.custom.lltm");
  Handle fn = CAPI(Object_GetAttrString)(module, function);
  Handle tuple = CAPI(Tuple_New)(static_cast<long>(args.size()));
  for (size_t i = 0; i < args.size(); ++i) CAPI(Tuple_SetItem)(tuple, static_cast<long>(i), WRAP(args[i]));
  Handle result = CAPI(Object_CallObject)(fn, tuple);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < outputs; ++i) out.push_back(UNWRAP(CAPI(Sequence_GetItem)(result, i)));
  CAPI(GILState_Release)(gil);
  return out;
}

std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  return in_python("lltm_forward", {input, weights, bias, old_h, old_cell}, 7);
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  return in_python("lltm_backward", {grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X,
                                     gate_weights, weights}, 5);
}
"""
