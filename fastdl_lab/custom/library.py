"""The LLTM cell as a PyTorch operator: ``torch.ops.fastdl.lltm_forward`` / ``lltm_backward``.

An ``autograd.Function`` that calls an extension is opaque to ``torch.compile``: Dynamo cannot
trace into pybind11 code, so it breaks the graph there (or fails under ``fullgraph=True``).
Registered with ``torch.library`` the cell is an operator like ``aten::addmm``:

- a *fake* implementation per op computes only the output shapes and dtypes, which is all the
  compiler's tracing (on FakeTensors) needs, so a model that calls the cell compiles as one graph;
- ``register_autograd`` connects the forward op to the backward op, so autograd (and AOTAutograd,
  which traces the backward graph ahead of time) differentiates through it.

Which implementation backs the ops: the ops backend installed for the inputs' device type with
``use_ops``, by default the hand-written Python ops (``PYTHON_OPS``) on every device. Importing
this module never builds C++ (a build takes half a minute and a compiler); whoever builds an
extension installs it explicitly (``use_ops(ops_of(module))``), as a grader does with a student's
build, and can put the previous backend back with the value ``use_ops`` returns, or use
``using_ops`` as a context manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from fastdl_lab.custom.lltm import PYTHON_OPS, LLTMOps

_OPS: dict[str, LLTMOps] = {}


def use_ops(ops: LLTMOps | None, device_type: str = "cpu") -> LLTMOps | None:
    """Back the ops with ``ops`` on ``device_type`` (None: the Python ops); returns the previous."""
    previous = _OPS.get(device_type)
    if ops is None:
        _OPS.pop(device_type, None)
    else:
        _OPS[device_type] = ops
    return previous


@contextlib.contextmanager
def using_ops(ops: LLTMOps | None, device_type: str = "cpu") -> Iterator[None]:
    previous = use_ops(ops, device_type)
    try:
        yield
    finally:
        use_ops(previous, device_type)


def current_ops(device_type: str = "cpu") -> LLTMOps:
    return _OPS.get(device_type, PYTHON_OPS)


def _own(outputs, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Copy any result that is a view or an input: an operator's results must own their memory.

    The Python and reference C++ ops never return one; a student's C++ (``d_X.narrow(...)`` for
    both d_old_h and d_input) may, and the op must stay valid whatever backend it runs.
    """
    seen: set[int] = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    owned = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if t._base is not None or (ptr is not None and ptr in seen):
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        owned.append(t)
    return tuple(owned)


@torch.library.custom_op("fastdl::lltm_forward", mutates_args=())
def lltm_forward(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights)."""
    args = (input, weights, bias, old_h, old_cell)
    return _own(current_ops(input.device.type).forward(*args), args)


@torch.library.custom_op("fastdl::lltm_backward", mutates_args=())
def lltm_backward(grad_h: Tensor, grad_cell: Tensor, new_cell: Tensor, input_gate: Tensor,
                  output_gate: Tensor, candidate_cell: Tensor, X: Tensor, gate_weights: Tensor,
                  weights: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(d_old_h, d_input, d_weights, d_bias, d_old_cell)."""
    args = (grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights)
    return _own(current_ops(grad_h.device.type).backward(*args), args)


@lltm_forward.register_fake
def _(input, weights, bias, old_h, old_cell):
    cell = old_cell.new_empty(old_cell.shape)
    # Seven distinct tensors: the fake results must not alias one another any more than the real.
    new_h, new_cell, input_gate, output_gate, candidate_cell = (torch.empty_like(cell) for _ in range(5))
    X = input.new_empty((input.shape[0], old_h.shape[1] + input.shape[1]))
    gate_weights = input.new_empty((input.shape[0], weights.shape[0]))
    return new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights


@lltm_backward.register_fake
def _(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights):
    state = grad_h.shape[1]
    return (grad_h.new_empty(grad_h.shape), X.new_empty((X.shape[0], X.shape[1] - state)),
            torch.empty_like(weights), weights.new_empty((weights.shape[0],)), grad_h.new_empty(grad_h.shape))


def _setup_context(ctx, inputs, output) -> None:
    weights = inputs[1]
    new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights = output
    ctx.save_for_backward(new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights)
    # The activations are returned for the backward's sake; nothing differentiates through them.
    ctx.mark_non_differentiable(input_gate, output_gate, candidate_cell, X, gate_weights)


def _backward(ctx, grad_h, grad_cell, *_activation_grads):
    new_cell = ctx.saved_tensors[0]
    # An output the loss does not use sends no gradient; the op needs a tensor either way.
    grad_h = torch.zeros_like(new_cell) if grad_h is None else grad_h
    grad_cell = torch.zeros_like(new_cell) if grad_cell is None else grad_cell
    d_old_h, d_input, d_weights, d_bias, d_old_cell = lltm_backward(grad_h, grad_cell, *ctx.saved_tensors)
    return d_input, d_weights, d_bias, d_old_h, d_old_cell


lltm_forward.register_autograd(_backward, setup_context=_setup_context)


def lltm_op(input: Tensor, weights: Tensor, bias: Tensor, old_h: Tensor, old_cell: Tensor) -> tuple[Tensor, Tensor]:
    """The cell through ``torch.ops.fastdl.lltm_forward``: (new_h, new_cell), differentiable."""
    new_h, new_cell, *_ = torch.ops.fastdl.lltm_forward(input, weights, bias, old_h, old_cell)
    return new_h, new_cell
