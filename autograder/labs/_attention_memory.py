"""Lab 05's memory cases: one attention at an N where an N x N fp32 matrix is hundreds of MiB, run
forward and backward in the child, checked here, its memory measured by the child's cgroup.

- ``host_backward``: what the ``attention_memory`` child runs where the student's wiring calls
  ``attention.launch_backward``. The student copy of the package has no backward kernels (they are
  another item's exercise, and under the interpreter they would take minutes at this N), so the
  grader stands in with PyTorch's own FlashAttention backward for the CPU: O(N) memory, from the
  q, k, v, o and logsumexp the wiring kept, in a fraction of a second. The student's forward kernel
  and wiring still decide everything the forward creates and keeps;
- ``attention``: the module the wiring's scope names ``attention``: the package's, with that one
  function replaced;
- ``exact`` and ``check_case``: the float64 output and gradients of a large case, from PyTorch's
  FlashAttention for the CPU (O(N) memory, under a second at N = 8192), and the check of a
  result against them by the rules of ``check_attention`` / ``check_attention_grads``.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch

from fastdl_lab import attention as _package
from fastdl_lab.attention.function import GRAD_RTOL, _judge
from fastdl_lab.checks import tolerance

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def host_backward(kernels, q, k, v, o, lse, do, causal: bool, scale: float, config: dict):
    """``launch_backward``'s arguments and results ((Z, N, D) tensors, the fp32 (Z, N) natural
    logsumexp), computed by PyTorch's CPU FlashAttention backward; ``kernels`` and ``config`` unused."""
    z, n, d = q.shape
    for name, t in (("k", k), ("v", v), ("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            raise ValueError(f"launch_backward: {name} must be a tensor of q's shape {tuple(q.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.numel() != z * n:
        raise ValueError(f"launch_backward: lse must hold one value per row, {z} x {n}")
    dtype = q.dtype

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).contiguous().view(1, z, n, d)

    dq, dk, dv = _BACKWARD(four(do), four(q), four(k), four(v), four(o), lse.float().contiguous().view(1, z, n),
                           0.0, bool(causal), scale=float(scale))
    return dq.view(z, n, d), dk.view(z, n, d), dv.view(z, n, d)


def _view() -> ModuleType:
    module = ModuleType(_package.__name__, _package.__doc__)
    module.__dict__.update({name: value for name, value in vars(_package).items() if not name.startswith("__")})
    module.launch_backward = host_backward
    return module


attention = _view()


def exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool, dtype=torch.float64):
    """(o, dq, dk, dv) of sum(do * attention(q, k, v)) in ``dtype``, without an N x N matrix."""
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    o, lse = _FORWARD(q, k, v, 0.0, bool(causal))[:2]
    return (o, *_BACKWARD(do, q, k, v, o, lse, 0.0, bool(causal)))


def _largest_product(a: torch.Tensor, b: torch.Tensor, rows: int = 1024) -> float:
    """max |a b^T| over the last two dimensions, ``rows`` rows of ``a`` at a time, in fp32: it only
    sizes a tolerance, and fp32 takes a tenth of float64's time at N = 8192."""
    a, b = a.float(), b.float()
    found = 0.0
    for i in range(0, a.shape[-2], rows):
        low, high = torch.aminmax(a[..., i:i + rows, :] @ b.transpose(-2, -1))
        found = max(found, float(high), -float(low))
    return found


def check_case(o, grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, causal: bool,
               name: str) -> None:
    """Raise ``checks.MismatchError`` (an AssertionError) unless ``o`` and ``grads`` (dq, dk, dv) are
    fp32 attention and its gradients: within fp32 tolerances of float64, or no worse than twice
    PyTorch's own fp32 error, each gradient's tolerance widened as ``check_attention_grads`` does."""
    wanted = exact(q, k, v, do, causal)
    ours = []

    def torch_result(i: int) -> torch.Tensor:
        if not ours:
            ours.extend(exact(q, k, v, do, causal, dtype=q.dtype))
        return ours[i]

    atol, rtol = tolerance(torch.float32)
    _judge(o, wanted[0], lambda: torch_result(0), q.dtype, atol, rtol, f"o for {name}")
    tau = 1.0 / math.sqrt(q.shape[-1])
    dp_max = _largest_product(do, v)
    bounds = (tau * dp_max * float(k.abs().max()), tau * dp_max * float(q.abs().max()), 0.0)
    for i, label in enumerate(("dq", "dk", "dv")):
        spread = max(float(wanted[1 + i].abs().max()), bounds[i])
        _judge(grads[i], wanted[1 + i], lambda i=i: torch_result(1 + i), q.dtype, atol + GRAD_RTOL * spread, rtol,
               f"{name} {label}")
