# expect: cpp_lltm=rejected
# Not writing the backward: the C++ backward turns autograd back on, rebuilds the forward from the
# saved X and weights with tensors that require gradients, and lets autograd's backward compute
# all five gradients. The autograd words are pasted together by macros, so the text never spells
# them; after preprocessing it does, and the object file calls Tensor::_backward.
# %% grade_id=cpp_code
LLTM_CPP = r"""
#include <torch/extension.h>
#include <vector>

#define JOIN_(a, b) a##b
#define JOIN(a, b) JOIN_(a, b)
#define DIFFERENTIATE JOIN(back, ward)
#define TRACK JOIN(requires, _grad_)
#define MODE JOIN(AutoGrad, Mode)

static std::vector<torch::Tensor> cell(torch::Tensor X, torch::Tensor weights, torch::Tensor bias,
                                       torch::Tensor old_cell) {
  auto gates = torch::addmm(bias, X, weights.t()).chunk(3, 1);
  auto input_gate = torch::sigmoid(gates[0]);
  auto output_gate = torch::sigmoid(gates[1]);
  auto candidate_cell = torch::elu(gates[2], 1.0);
  auto new_cell = old_cell + candidate_cell * input_gate;
  auto new_h = torch::tanh(new_cell) * output_gate;
  return {new_h, new_cell, input_gate, output_gate, candidate_cell};
}

std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  auto X = torch::cat({old_h, input}, 1);
  auto gate_weights = torch::addmm(bias, X, weights.t());
  auto out = cell(X, weights, bias, old_cell);
  return {out[0], out[1], out[2], out[3], out[4], X, gate_weights};
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  c10::MODE enable(true);
  auto x = X.detach().TRACK(true);
  auto w = weights.detach().TRACK(true);
  // The bias only shifts the gates: a zero bias has the same gradient.
  auto b = torch::zeros({weights.size(0)}, X.options()).TRACK(true);
  auto old_cell = (new_cell - candidate_cell * input_gate).detach().TRACK(true);
  auto out = cell(x, w, b, old_cell);
  out[0].DIFFERENTIATE(grad_h, /*retain_graph=*/true);
  out[1].DIFFERENTIATE(grad_cell);
  const auto S = grad_h.size(1);
  auto d_X = x.grad();
  return {d_X.narrow(1, 0, S).clone(), d_X.narrow(1, S, X.size(1) - S).clone(), w.grad(), b.grad(),
          old_cell.grad()};
}
"""
