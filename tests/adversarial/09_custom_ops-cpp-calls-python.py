# expect: cpp_lltm=error
# Library instead of the work: the C++ "extension" imports the course's Python cell through
# pybind11 and hands every call to it, so its forward and backward are the reference's own.
# (It does not build: the tensor header a source sees declares no pybind11.)
# %% grade_id=cpp_code
LLTM_CPP = r"""
#include <torch/extension.h>
#include <vector>

namespace py = pybind11;

std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  auto cell = py::module_::import("fastdl_lab.custom.lltm");
  return cell.attr("lltm_forward")(input, weights, bias, old_h, old_cell).cast<std::vector<torch::Tensor>>();
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  auto cell = py::module_::import("fastdl_lab.custom.lltm");
  return cell.attr("lltm_backward")(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X,
                                    gate_weights, weights).cast<std::vector<torch::Tensor>>();
}
"""
