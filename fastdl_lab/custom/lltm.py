"""The LLTM cell in Python: the autograd reference, the hand-written ops, the autograd.Function.

The cell (lab 09): with X = [old_h, input], gates = X W^T + b is split into three equal blocks;
the input and output gates are sigmoids of the first two, the candidate is ELU(alpha=1) of the
third; new_cell = old_cell + candidate * input_gate and new_h = tanh(new_cell) * output_gate.

An *ops backend* is anything with ``forward`` and ``backward`` callables of the same signature
as the C++ functions ``lltm_forward`` and ``lltm_backward`` (see ``LLTMOps``), so the Python ops
here, a C++ build and a CUDA build are interchangeable under one ``LLTMFunction``:

    forward(input, weights, bias, old_h, old_cell)
        -> [new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights]
    backward(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X,
             gate_weights, weights)
        -> [d_old_h, d_input, d_weights, d_bias, d_old_cell]

Shapes: input (B, I), old_h and old_cell (B, S), weights (3S, S + I), bias (3S,).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdl_lab import checks
from fastdl_lab.custom import sources


def lltm_ref(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
             old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """The specification: the cell in plain PyTorch, differentiated by autograd."""
    X = torch.cat([old_h, input], dim=1)
    input_gate, output_gate, candidate = torch.addmm(bias, X, weights.t()).chunk(3, dim=1)
    new_cell = old_cell + F.elu(candidate) * torch.sigmoid(input_gate)
    new_h = torch.tanh(new_cell) * torch.sigmoid(output_gate)
    return new_h, new_cell


def lltm_forward(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor,
                 old_cell: Tensor) -> list[Tensor]:
    """The forward written out, returning what the hand-written backward needs besides weights."""
    X = torch.cat([old_h, input], dim=1)
    gate_weights = torch.addmm(bias, X, weights.t())
    pre_input, pre_output, pre_candidate = gate_weights.chunk(3, dim=1)
    input_gate = torch.sigmoid(pre_input)
    output_gate = torch.sigmoid(pre_output)
    candidate_cell = F.elu(pre_candidate)
    new_cell = old_cell + candidate_cell * input_gate
    new_h = torch.tanh(new_cell) * output_gate
    return [new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights]


def lltm_backward(grad_h: Tensor, grad_cell: Tensor, new_cell: Tensor, input_gate: Tensor,
                  output_gate: Tensor, candidate_cell: Tensor, X: Tensor, gate_weights: Tensor,
                  weights: Tensor) -> list[Tensor]:
    """The chain rule by hand, from the saved activations (no autograd graph)."""
    tanh_cell = torch.tanh(new_cell)
    # new_cell reaches the loss directly (grad_cell) and through new_h = tanh(new_cell) * o.
    d_new_cell = grad_cell + grad_h * output_gate * (1 - tanh_cell * tanh_cell)
    # The sigmoids' derivative s (1 - s) comes from the saved gate values, not a recomputation.
    d_input_pre = d_new_cell * candidate_cell * input_gate * (1 - input_gate)
    d_output_pre = grad_h * tanh_cell * output_gate * (1 - output_gate)
    # ELU(alpha=1) is z for z > 0, else exp(z) - 1, whose derivative exp(z) is the output + 1.
    pre_candidate = gate_weights.chunk(3, dim=1)[2]
    d_elu = torch.where(pre_candidate > 0, torch.ones_like(candidate_cell), candidate_cell + 1)
    d_candidate_pre = d_new_cell * input_gate * d_elu
    d_gates = torch.cat([d_input_pre, d_output_pre, d_candidate_pre], dim=1)
    d_weights = d_gates.t().mm(X)
    d_bias = d_gates.sum(dim=0)
    # Two products rather than two slices of one: the outputs stay separate tensors, which
    # torch.library requires of an op's results (no output may alias another).
    state_size = grad_h.shape[1]
    d_old_h = d_gates.mm(weights[:, :state_size])
    d_input = d_gates.mm(weights[:, state_size:])
    return [d_old_h, d_input, d_weights, d_bias, d_new_cell]


class LLTMOps(NamedTuple):
    """An ops backend: the two functions and a name for tables and messages."""
    forward: Callable[..., list[Tensor]]
    backward: Callable[..., list[Tensor]]
    name: str


PYTHON_OPS = LLTMOps(lltm_forward, lltm_backward, "python")


def ops_of(module, name: str | None = None) -> LLTMOps:
    """The ops of a built extension (a module with ``lltm_forward`` and ``lltm_backward``)."""
    missing = [f for f in ("lltm_forward", "lltm_backward") if not callable(getattr(module, f, None))]
    if missing:
        raise TypeError(f"{module!r} has no callable {' or '.join(missing)}")
    return LLTMOps(module.lltm_forward, module.lltm_backward, name or getattr(module, "__name__", "extension"))


class LLTMFunction(torch.autograd.Function):
    """The cell as one autograd node whose forward and backward are an ops backend's."""

    @staticmethod
    def forward(ctx, input, weights, bias, old_h, old_cell, ops: LLTMOps = PYTHON_OPS):
        new_h, new_cell, *activations = ops.forward(input, weights, bias, old_h, old_cell)
        # The backward needs the saved activations, not the inputs: X carries old_h and input.
        ctx.save_for_backward(new_cell, *activations, weights)
        ctx.ops = ops
        return new_h, new_cell

    @staticmethod
    def backward(ctx, grad_h, grad_cell):
        d_old_h, d_input, d_weights, d_bias, d_old_cell = ctx.ops.backward(grad_h, grad_cell, *ctx.saved_tensors)
        return d_input, d_weights, d_bias, d_old_h, d_old_cell, None


def lltm_cell(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor,
              ops: LLTMOps = PYTHON_OPS) -> tuple[Tensor, Tensor]:
    """The cell through ``LLTMFunction`` with the given ops backend: (new_h, new_cell)."""
    return LLTMFunction.apply(input, weights, bias, old_h, old_cell, ops)


def make_inputs(batch: int, input_features: int, state_size: int, *, dtype: torch.dtype = torch.float32,
                seed: int = 0, device: str | torch.device = "cpu", requires_grad: bool = False) -> list[Tensor]:
    """Seeded (input, weights, bias, old_h, old_cell), weights at the module's initial scale."""
    bound = 1.0 / math.sqrt(state_size)
    shapes = [(batch, input_features), (3 * state_size, input_features + state_size), (3 * state_size,),
              (batch, state_size), (batch, state_size)]
    # Weights of the init's size put the gates where the sigmoid and ELU bend (both signs of z).
    scales = [1.0, bound, bound, 1.0, 1.0]
    return [checks.randn(shape, dtype=dtype, seed=seed + i, device=device, scale=scale).requires_grad_(requires_grad)
            for i, (shape, scale) in enumerate(zip(shapes, scales))]


GRAD_NAMES = ("input", "weights", "bias", "old_h", "old_cell")


def check_ops(ops: LLTMOps, inputs: list[Tensor], *, atol: float | None = None, rtol: float | None = None) -> None:
    """``ops`` through ``LLTMFunction`` against ``lltm_ref``: both outputs and all five gradients.

    Tolerances per dtype from ``checks`` unless given; raises ``checks.MismatchError`` naming the
    first tensor that differs, with its worst elements.
    """
    leaves = [t.detach().requires_grad_() for t in inputs]
    expected = lltm_ref(*leaves)
    actual = lltm_cell(*leaves, ops=ops)
    grad_h, grad_cell = (checks.randn(expected[0].shape, dtype=expected[0].dtype, seed=100 + i,
                                      device=expected[0].device) for i in range(2))
    for name, a, e in zip(("new_h", "new_cell"), actual, expected):
        checks.assert_close(a.detach(), e.detach(), atol=atol, rtol=rtol, name=f"{ops.name} {name}")
    want = torch.autograd.grad(expected, leaves, (grad_h, grad_cell))
    got = torch.autograd.grad(actual, leaves, (grad_h, grad_cell))
    for name, a, e in zip(GRAD_NAMES, got, want):
        checks.assert_close(a, e, atol=atol, rtol=rtol, name=f"{ops.name} d_{name}")


BACKENDS = ("python", "cpp", "cuda")


class LLTM(nn.Module):
    """One LLTM cell: ``forward(input, (h, c)) -> (new_h, new_cell)``.

    ``backend``: "python" (the hand-written ops), "cpp" or "cuda" (a built extension). For the
    compiled backends pass ``ops=`` (``ops_of(module)`` of a build; it overrides ``backend``);
    without it "cpp" builds the reference source with ``build_cpp`` (about 5 s the first time
    where ``pch.ensure`` has run, 25 s where not; then cached) and "cuda" builds the CUDA source, which needs a GPU host.
    """

    def __init__(self, input_features: int, state_size: int, backend: str = "python",
                 ops: LLTMOps | None = None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.input_features, self.state_size, self.backend = input_features, state_size, backend
        self.weights = nn.Parameter(torch.empty(3 * state_size, input_features + state_size))
        self.bias = nn.Parameter(torch.empty(3 * state_size))
        self.ops = ops or self._default_ops(backend)
        self.reset_parameters()

    @staticmethod
    def _default_ops(backend: str) -> LLTMOps:
        if backend == "python":
            return PYTHON_OPS
        if backend == "cpp":
            return ops_of(sources.build_cpp(name="fastdl_lltm_cpp"), "cpp")
        return ops_of(sources.build_cuda(name="fastdl_lltm_cuda"), "cuda")

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.state_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, input: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        old_h, old_cell = state
        return lltm_cell(input, self.weights, self.bias, old_h, old_cell, self.ops)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}, backend={self.ops.name}"
