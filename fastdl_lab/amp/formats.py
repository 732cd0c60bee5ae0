"""Number formats of mixed precision, their facts read from ``torch.finfo`` and shown by experiment.

Every experiment returns plain numbers, lists and dicts, so that the lab can plot them and the
tests can assert them. Values are rounded *through* a format and handed back in fp32: the fp8
types have almost no arithmetic on the CPU, but casting to them and back works everywhere.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fastdl_lab import checks


@dataclasses.dataclass(frozen=True)
class Format:
    """One floating-point format. ``bits`` counts the bits that carry the value (sign, exponent,
    mantissa); ``storage_bytes`` what a tensor of it takes in memory (tf32 lives in fp32 words)."""

    name: str
    dtype: torch.dtype
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    storage_bytes: int

    @property
    def binades(self) -> float:
        """Powers of two between the smallest subnormal and the largest value: the dynamic range."""
        return math.log2(self.max / self.smallest_subnormal)


def _from_finfo(name: str, dtype: torch.dtype) -> Format:
    info = torch.finfo(dtype)
    # eps is the gap above 1.0, 2^-mantissa_bits; what the sign and mantissa leave is exponent.
    mantissa = round(-math.log2(info.eps))
    return Format(name, dtype, info.bits, info.bits - 1 - mantissa, mantissa, info.max, info.smallest_normal,
                  info.smallest_normal * info.eps, info.eps, dtype.itemsize)


def _tf32() -> Format:
    # TF32 keeps fp32's 8-bit exponent and cuts the mantissa to fp16's 10 bits. torch has no dtype
    # for it, so its facts follow from fp32's: same exponent range, 13 fewer mantissa bits. Its max
    # is fp32's max with those 13 bits cleared, which is what truncating fp32's max gives.
    fp32 = _from_finfo("fp32", torch.float32)
    mantissa = 10
    largest = float(checks.truncate_to_tf32(torch.tensor(fp32.max)))
    return dataclasses.replace(fp32, name="tf32", bits=1 + fp32.exponent_bits + mantissa, mantissa_bits=mantissa,
                               max=largest, smallest_subnormal=fp32.smallest_normal * 2.0**-mantissa,
                               eps=2.0**-mantissa)


FORMATS: dict[str, Format] = {
    "fp32": _from_finfo("fp32", torch.float32),
    "tf32": _tf32(),
    "fp16": _from_finfo("fp16", torch.float16),
    "bf16": _from_finfo("bf16", torch.bfloat16),
    "fp8_e4m3": _from_finfo("fp8_e4m3", torch.float8_e4m3fn),
    "fp8_e5m2": _from_finfo("fp8_e5m2", torch.float8_e5m2),
}


def _format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; the formats are {sorted(FORMATS)}")
    return FORMATS[name]


def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest value with a 10-bit mantissa, ties to even.

    Every other format here is reached by a cast, which rounds to nearest even; TF32 is rounded
    the same way so that the experiments compare like with like. ``checks.truncate_to_tf32``
    chops the bits instead, which models a tensor core reading unrounded fp32 operands and is
    biased toward zero. Adding half a unit of the kept last place (less one, plus that bit itself)
    before clearing the 13 low bits rounds to nearest even; a carry out of the mantissa moves
    the exponent up, so the largest values round to inf as a cast would.
    """
    bits = x.contiguous().view(torch.int32)
    kept_lsb = (bits >> 13) & 1
    rounded = ((bits + 0xFFF + kept_lsb) & ~0x1FFF).view(torch.float32)
    # A NaN whose payload sits only in the cleared bits would otherwise come out as inf.
    return torch.where(torch.isnan(x), x, rounded)


def round_to(x, name: str) -> torch.Tensor:
    """``x`` (a tensor or anything ``torch.as_tensor`` takes) rounded through format ``name``, in fp32."""
    fmt = _format(name)
    x = torch.as_tensor(x, dtype=torch.float32)
    if name == "tf32":
        return _round_to_tf32(x)
    return x.to(fmt.dtype).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Experiments


def overflow_experiment(xs=None, names=tuple(FORMATS)) -> dict:
    """exp(x) stored in each format over a sweep of x: where an activation becomes inf.

    Returns ``x`` (the sweep), ``values`` (per format, exp(x) computed in fp32 then rounded
    through the format), ``first_inf`` (per format, the first x whose value is inf or NaN; None
    if none is) and ``largest_finite`` (per format, the largest finite value reached). fp16 runs
    out at exp(11.09) = 65504; bf16 lasts as long as fp32, to exp(88.7).
    """
    xs = torch.arange(0.0, 100.5, 0.5) if xs is None else torch.as_tensor(xs, dtype=torch.float32)
    exact = torch.exp(xs)
    out = {"x": xs.tolist(), "values": {}, "first_inf": {}, "largest_finite": {}}
    for name in names:
        stored = round_to(exact, name)
        bad = ~torch.isfinite(stored)
        out["values"][name] = stored.tolist()
        out["first_inf"][name] = float(xs[bad][0]) if bool(bad.any()) else None
        out["largest_finite"][name] = float(stored[~bad].max())
    return out


def gradient_sample(n: int = 1 << 16, seed: int = 0, log2_mean: float = -20.0, log2_std: float = 5.0) -> torch.Tensor:
    """Signed values whose magnitudes are log-normal: log2|g| ~ Normal(log2_mean, log2_std).

    Gradient histograms of real networks (activation gradients above all) spread over dozens of
    binades, most of the mass far below 1; the defaults put the median at 2^-20 (1e-6) and a
    sixth of the values below fp16's smallest subnormal, 2^-24.
    """
    gen = checks.generator(seed)
    log2 = torch.randn(n, generator=gen, dtype=torch.float64) * log2_std + log2_mean
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    return (sign * torch.exp2(log2)).float()


def gradient_underflow(scale: float = 1.0, grads: torch.Tensor | None = None, names=tuple(FORMATS)) -> dict:
    """Fractions of ``grads * scale`` flushed to zero, and lost to overflow, in each format.

    ``grads`` defaults to ``gradient_sample()``. Overflow counts values that become inf or NaN,
    and values stored as the format's max although they are larger (this torch's cast to e4m3
    saturates: that format has no inf). Returns ``scale``, ``zero`` and ``overflow``, per format.
    Scaling by 2^k shifts the whole histogram up k binades: fewer zeros, until the top overflows.
    """
    g = (gradient_sample() if grads is None else grads).double() * scale
    # Products that leave fp32's own range are overflow, not an fp32 value to round.
    true = g.float()
    out = {"scale": scale, "zero": {}, "overflow": {}}
    for name in names:
        fmt = _format(name)
        stored = round_to(true, name)
        out["zero"][name] = float(((stored == 0) & (g != 0)).double().mean())
        saturated = (stored.abs() == fmt.max) & (g.abs() > fmt.max)
        out["overflow"][name] = float((~torch.isfinite(stored) | saturated).double().mean())
    return out


def lost_update_experiment(w: float = 1.0, lr: float = 1e-3, grad: float = 1e-2, steps: int = 1000,
                           names=("fp32", "fp16", "bf16")) -> dict:
    """One weight updated ``w - lr * grad`` ``steps`` times, the weight kept in each format.

    The update (1e-5 at the defaults) is smaller than half the gap between w and its neighbours in
    bf16 (2^-9 below 1.0) and in fp16 (2^-12), so rounding returns w unchanged, every step:
    the weight never moves. In fp32 half the gap is 2^-25 and the updates add up. Hence fp32 master
    weights. Returns ``update``, ``first_step`` (per format, how far the first step moved w),
    ``final`` (per format, w after all steps) and ``expected`` (the exact final value).
    """
    update = lr * grad
    out = {"update": update, "first_step": {}, "final": {}, "expected": w - steps * update}
    for name in names:
        value = round_to(w, name)
        start = float(value)
        for step in range(steps):
            value = round_to(value - update, name)
            if step == 0:
                out["first_step"][name] = float(value) - start
        out["final"][name] = float(value)
    return out


def long_sum_experiment(n: int = 100_000, seed: int = 0, points: int = 100) -> dict:
    """A running sum of n values uniform in [0, 1), each partial sum rounded to the accumulator's format.

    Once an fp16 sum reaches 2048 its neighbours are 2 apart, so adding anything below 1 rounds back
    to the same sum: it stagnates while the true sum goes on to n/2. An fp32 accumulator over the
    same fp16 inputs is the remedy every reduction kernel uses. Returns ``exact`` (fp64), the
    final sums ``fp32``, ``fp16`` and ``fp16_inputs_fp32_sum``, and ``curve``: the partial sums at
    ``points`` evenly spaced counts, for plotting.
    """
    values = np.random.default_rng(seed).random(n)
    # NumPy's accumulate adds left to right and rounds every partial sum to the array's dtype; a
    # plain sum would add pairwise, and torch's CPU sums of fp16 accumulate in fp32.
    partial = {"fp32": np.add.accumulate(values.astype(np.float32)),
               "fp16": np.add.accumulate(values.astype(np.float16)),
               "fp16_inputs_fp32_sum": np.add.accumulate(values.astype(np.float16).astype(np.float32))}
    at = np.linspace(0, n - 1, points).round().astype(int)
    out = {"n": n, "exact": float(values.sum()), **{k: float(v[-1]) for k, v in partial.items()}}
    out["curve"] = {"count": (at + 1).tolist(), "exact": np.cumsum(values)[at].tolist(),
                    **{k: v[at].astype(float).tolist() for k, v in partial.items()}}
    return out
