"""The one correctness harness: tolerances, readable mismatch reports, seeded inputs, output
poisoning and aliasing checks, shared by labs, tests, benchmarks and the grader.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

# (atol, rtol) per dtype. torch.testing's fp32 rtol (1.3e-6, about 10 ulp) assumes the same
# operation order as the reference; tiled and fused kernels reduce in a different order, so fp32
# allows about 80 ulp (rtol 1e-5) and an equal atol for results that cancel to near zero. fp16
# keeps about one ulp relative (eps 9.8e-4) and bf16 two (eps 7.8e-3); their atols cover
# near-zero results the same way. float64 is held close to its reference.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for comparing results of ``dtype``; integers and bools must match exactly."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0, 0.0
    raise ValueError(f"no default tolerance for {dtype}; pass atol and rtol explicitly")


class MismatchError(AssertionError):
    def __init__(self, report: str):
        super().__init__(report)
        self.report = report


# --------------------------------------------------------------------------------------------
# Reports


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def _positions(mask: torch.Tensor, shape: torch.Size, limit: int) -> str:
    flat = mask.reshape(-1).nonzero().reshape(-1)
    shown = ", ".join(str(_index(int(i), shape)) for i in flat[:limit])
    more = f", ... ({flat.numel() - limit} more)" if flat.numel() > limit else ""
    return f"{flat.numel()} at {shown}{more}"


def _close_mask(a: torch.Tensor, e: torch.Tensor, atol: float, rtol: float,
                equal_nan: bool) -> torch.Tensor:
    # Equality first so that matching infinities (whose difference is NaN) count as close; an
    # infinite expected value would make the tolerance infinite, so only equality can match it.
    close = (a == e) | (e.isfinite() & ((a - e).abs() <= atol + rtol * e.abs()))
    if equal_nan:
        close |= a.isnan() & e.isnan()
    return close


def mismatch_report(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                    *, k: int = 5, name: str = "output", equal_nan: bool = False) -> str:
    """Describe how ``actual`` differs from ``expected``: counts, maxima, worst k, NaN/Inf spots."""
    if actual.shape != expected.shape:
        raise ValueError(f"{name}: shapes differ, {tuple(actual.shape)} vs "
                         f"{tuple(expected.shape)}; nothing to compare element-wise")
    shape = expected.shape
    a, e = _as_float64(actual), _as_float64(expected)
    bad = ~_close_mask(a, e, atol, rtol, equal_nan)
    n_bad, total = int(bad.sum()), e.numel()
    lines = [f"{name}: {n_bad} of {total} elements ({100 * n_bad / max(total, 1):.2f}%) differ "
             f"beyond atol={atol:g}, rtol={rtol:g}",
             f"  shape {tuple(shape)}, dtype {actual.dtype} (expected {expected.dtype})"]

    abs_err = (a - e).abs()
    finite = a.isfinite() & e.isfinite()
    if finite.any():
        err = torch.where(finite, abs_err, 0.0).reshape(-1)
        rel = torch.where(finite, abs_err / e.abs(), 0.0).nan_to_num(nan=0.0).reshape(-1)
        i_abs, i_rel = int(err.argmax()), int(rel.argmax())
        lines.append(f"  max abs error {err[i_abs]:.3g} at {_index(i_abs, shape)}; "
                     f"max rel error {rel[i_rel]:.3g} at {_index(i_rel, shape)}")

    if n_bad:
        # Rank by how far past the allowed error each element is; non-finite misses rank first.
        excess = (abs_err - (atol + rtol * e.abs())).nan_to_num(nan=float("inf"))
        excess = torch.where(bad, excess, -float("inf")).reshape(-1)
        worst = excess.topk(min(k, n_bad)).indices
        flat_a, flat_e = a.reshape(-1), e.reshape(-1)
        lines.append(f"  worst {len(worst)}: index: actual vs expected (abs error)")
        for i in worst.tolist():
            lines.append(f"    {_index(i, shape)}: {flat_a[i]:.6g} vs {flat_e[i]:.6g} "
                         f"({abs(flat_a[i] - flat_e[i]):.3g})")

    for label, t in (("actual", a), ("expected", e)):
        for kind, mask in (("NaN", t.isnan()), ("Inf", t.isinf())):
            if mask.any():
                lines.append(f"  {kind} in {label}: {_positions(mask, shape, k)}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Assertions


def _check_tensor(actual, expected: torch.Tensor, name: str) -> None:
    if not isinstance(actual, torch.Tensor):
        raise MismatchError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
    # A subclass can defer or fake its values until they are read; only plain tensors count.
    if type(actual) not in (torch.Tensor, torch.nn.Parameter):
        raise MismatchError(f"{name}: got a tensor subclass {type(actual).__name__}; "
                            "return a plain torch.Tensor")
    if actual.shape != expected.shape:
        raise MismatchError(f"{name}: shape {tuple(actual.shape)}, expected "
                            f"{tuple(expected.shape)}")
    if actual.device.type != expected.device.type:
        raise MismatchError(f"{name}: on device {actual.device}, expected {expected.device}")


def assert_close(actual, expected: torch.Tensor, *, atol: float | None = None,
                 rtol: float | None = None, dtype: torch.dtype | None = None,
                 name: str = "output", equal_nan: bool = False) -> None:
    """Check type, shape, device and dtype, then values within per-dtype tolerances.

    Tolerances come from ``dtype`` (default ``expected.dtype``) unless given; values are
    compared in float64. A NaN is a mismatch unless ``equal_nan`` and expected is NaN there too.
    """
    _check_tensor(actual, expected, name)
    if actual.dtype != expected.dtype:
        raise MismatchError(f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    default_atol, default_rtol = tolerance(dtype or expected.dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    if not _close_mask(_as_float64(actual), _as_float64(expected), atol, rtol, equal_nan).all():
        raise MismatchError(mismatch_report(actual, expected, atol, rtol, name=name,
                                            equal_nan=equal_nan))


def assert_low_precision_close(actual, reference_fp32: torch.Tensor, torch_lowp: torch.Tensor,
                               *, factor: float = 2.0, name: str = "output") -> None:
    """The low-precision rule: no worse than ``factor`` x PyTorch's own error against fp32.

    ``actual`` and ``torch_lowp`` are the same computation in the same low precision (the
    student's and PyTorch's); ``reference_fp32`` is it in fp32 or better. The bound gets a floor
    of one fp32 rounding unit at the reference's scale, so an exact PyTorch result still leaves
    room for the fp32 reference's own rounding.
    """
    _check_tensor(actual, torch_lowp, name)
    if actual.dtype != torch_lowp.dtype:
        raise MismatchError(f"{name}: dtype {actual.dtype}, expected {torch_lowp.dtype} "
                            "(the same precision as PyTorch's low-precision result)")
    if reference_fp32.shape != actual.shape:
        raise ValueError(f"{name}: reference shape {tuple(reference_fp32.shape)} differs from "
                         f"{tuple(actual.shape)}")
    ref = _as_float64(reference_fp32)
    err = (_as_float64(actual) - ref).abs().max()
    torch_err = float((_as_float64(torch_lowp) - ref).abs().max())
    scale = max(float(ref.abs().max()), 1.0)
    bound = factor * torch_err + torch.finfo(torch.float32).eps * scale
    # `not <=` also catches a NaN error.
    if not float(err) <= bound:
        header = (f"{name}: max abs error {float(err):.3g} against the fp32 reference exceeds "
                  f"{factor:g} x PyTorch's {torch_lowp.dtype} error {torch_err:.3g} "
                  f"(bound {bound:.3g})")
        raise MismatchError(header + "\n" + mismatch_report(actual, reference_fp32, bound, 0.0,
                                                           name=name))


# --------------------------------------------------------------------------------------------
# TF32: what tensor cores do to fp32 operands


def truncate_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (fp32) with the 13 low mantissa bits cleared: the 10-bit mantissa a TF32 unit reads.

    Tensor cores read fp32 operands of a TF32 product this way unless the code rounds them first,
    so a kernel that rounds to nearest is at least as accurate as this emulation.
    """
    if t.dtype != torch.float32:
        raise TypeError(f"TF32 emulation takes float32, got {t.dtype}")
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def exact_fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in true fp32 on any device, whatever a notebook set ``allow_tf32`` to."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return torch.matmul(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def tf32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as a TF32 tensor core computes it (truncated operands, fp32 accumulation): the
    like-for-like baseline of an fp32 ``tl.dot`` on a GPU.

    PyTorch's own TF32 path is no such baseline: cuBLAS keeps small or thin products in true fp32,
    which would hold a kernel to an accuracy that TF32 cannot have.
    """
    return exact_fp32_matmul(truncate_to_tf32(a), truncate_to_tf32(b))


# --------------------------------------------------------------------------------------------
# Seeded inputs


def generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(*shape, dtype: torch.dtype = torch.float32, seed: int = 0,
          device: str | torch.device = "cpu", scale: float = 1.0,
          offset: float = 0.0) -> torch.Tensor:
    """Normal samples from ``seed``, the same values on every device and in every dtype.

    Drawn on the CPU in fp32, then scaled, cast and moved: CUDA generators give other streams,
    and a regrade on a different machine must see the same inputs.
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    values = torch.randn(*shape, generator=generator(seed), dtype=torch.float32)
    return (values * scale + offset).to(device=device, dtype=dtype)


def fresh_seed() -> int:
    """A secret per-run seed (63 bits, so it fits signed 64-bit storage)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


# --------------------------------------------------------------------------------------------
# Output poisoning


def _poison_value(dtype: torch.dtype) -> float | int:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    # Integers have no NaN; the most negative value is an unlikely honest result.
    return torch.iinfo(dtype).min


def poisoned_empty(shape, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """An output buffer whose unwritten elements cannot pass a check (bool is not supported)."""
    return torch.empty(shape, dtype=dtype, device=device).fill_(_poison_value(dtype))


def output_buffer(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A kernel's output on ``like``'s device: poisoned on the CPU, so that whatever a kernel
    forgets to write fails the comparison; plain ``empty`` on a GPU, where filling would cost a
    pass over memory inside timed launches."""
    if like.is_cuda:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return poisoned_empty(shape, dtype=dtype)


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t).fill_(_poison_value(t.dtype))


# --------------------------------------------------------------------------------------------
# Aliasing


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _is_dense(t: torch.Tensor) -> bool:
    """Whether the elements tile their span exactly once (any dimension order, no gaps)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _element_starts(t: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (t.data_ptr() + offsets.reshape(-1) * t.element_size()).unique()


def _intervals_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact test for strided tensors whose spans interleave (e.g. two columns of one matrix)."""
    starts_a, size_a = _element_starts(a), a.element_size()
    starts_b, size_b = _element_starts(b), b.element_size()
    # All of a's elements have one length, so among those starting before a b element ends,
    # the last one reaches furthest: it is the only candidate for an overlap.
    ends_b = starts_b + size_b
    before = torch.searchsorted(starts_a, ends_b) - 1
    has_prev = before >= 0
    prev_end = starts_a[before.clamp(min=0)] + size_a
    return bool((has_prev & (prev_end > starts_b)).any())


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether any byte of ``a``'s elements is also a byte of ``b``'s elements."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    (lo_a, hi_a), (lo_b, hi_b) = _byte_span(a), _byte_span(b)
    if lo_a >= hi_b or lo_b >= hi_a:
        return False
    if _is_dense(a) and _is_dense(b):
        return True
    return _intervals_overlap(a, b)


def assert_no_alias(output: torch.Tensor, inputs: Iterable[torch.Tensor],
                    name: str = "output") -> None:
    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor) and shares_memory(output, t):
            raise AssertionError(f"{name} aliases input #{i} (shares memory with it); "
                                 "return a newly allocated tensor")
