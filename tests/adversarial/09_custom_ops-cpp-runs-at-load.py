# expect: cpp_lltm=rejected
# Code at load time: a constructor function would run when the extension is loaded, before any
# check, and tries to leave a result file where the grader once read outputs. The grader refuses
# the build before anything loads it: the preprocessed source names a linker attribute
# (__attribute__((constructor))), and the object calls fopen.
# %% grade_id=cpp_code
LLTM_CPP = r"""
#include <torch/extension.h>
#include <vector>
#include <cstdio>

__attribute__((constructor)) static void before_anything() {
  FILE* out = std::fopen("/job/outputs.pt", "w");
  if (out) { std::fputs("forged", out); std::fclose(out); }
}

std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  return {old_h, old_cell, old_h, old_h, old_h, old_h, old_h};
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  return {grad_h, grad_h, weights, weights, grad_cell};
}
"""
