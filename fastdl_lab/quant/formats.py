"""Integer formats: mapping floats to int8 and back, and what the mapping costs (lab 09 custom ops).

A tensor is quantised with a scale (and, asymmetrically, a zero point): ``q = clamp(round(x /
scale) + zero_point)``, read back as ``(q - zero_point) * scale``. What the rounding loses depends
on how many values share one scale:

- ``quantize`` / ``dequantize``: per tensor (one scale) or per channel (one scale per slice along
  ``axis``), symmetric or asymmetric, any width up to 8 bits, stored in int8;
- ``quantize_per_channel_ref``: the graded form of the weight case, symmetric int8 with one scale
  per output channel, and ``check_per_channel`` to judge any answer to it;
- ``dynamic_activation_scale`` / ``quantize_activation``: a scale per row (per token) taken from
  the activation itself at run time, as W8A8 inference does;
- ``quantization_error``: how far the round trip lands from the original (max abs, relative
  Frobenius, signal-to-noise ratio);
- ``train_regression_mlp`` / ``trained_layer``: a layer trained for a few hundred steps, whose
  rows differ in range as trained layers' do, to measure per-tensor against per-channel on;
  ``row_range_ratio`` says by how much.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks


def qrange(bits: int) -> tuple[int, int]:
    """The integer grid of a ``bits``-wide code: [-(2^(bits-1) - 1), 2^(bits-1) - 1].

    One grid for every mode, dropping the most negative code (-128 for int8): then ``-q`` is
    always representable, a symmetric scale maps ``+absmax`` and ``-absmax`` to codes of equal
    size, and no int8 product reaches 128 * 128.
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8 (codes are stored in int8), got {bits}")
    qmax = 2 ** (bits - 1) - 1
    return -qmax, qmax


def _along(t: torch.Tensor, axis: int | None, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast along ``axis`` of an ``ndim``-D tensor."""
    if axis is None:
        return t
    shape = [1] * ndim
    shape[axis] = -1
    return t.reshape(shape)


def _reduce(x: torch.Tensor, axis: int | None, fn) -> torch.Tensor:
    """``fn`` (amin / amax) over everything, or over every dimension but ``axis``."""
    if axis is None:
        return fn(x)
    dims = [d for d in range(x.dim()) if d != axis]
    return fn(x, dim=dims) if dims else x


def quantize(x: torch.Tensor, *, bits: int = 8, symmetric: bool = True,
             axis: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, zero_point)``: int8 codes, fp32 scale(s), int32 zero point(s).

    ``axis=None`` gives one scale for the whole tensor; an integer gives one per slice along that
    dimension (``scale`` then has ``x.shape[axis]`` entries). Symmetric: ``scale = absmax / qmax``
    and a zero point of 0. Asymmetric: the range [min, max], widened to hold 0 so that zero (ReLU
    outputs, padding) is stored exactly, is spread over the whole grid. A slice that is all zeros
    gets scale 1: any positive scale stores it exactly, and 0 would divide by zero.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating tensor, got {x.dtype}")
    if axis is not None:
        axis = axis % x.dim()
    qmin, qmax = qrange(bits)
    xf = x.detach().float()
    if symmetric:
        absmax = _reduce(xf.abs(), axis, torch.amax)
        scale = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
        zero_point = torch.zeros_like(scale, dtype=torch.int32)
    else:
        lo = _reduce(xf, axis, torch.amin).clamp(max=0)
        hi = _reduce(xf, axis, torch.amax).clamp(min=0)
        span = hi - lo
        scale = torch.where(span > 0, span / (qmax - qmin), torch.ones_like(span))
        zero_point = (qmin - torch.round(lo / scale)).to(torch.int32)
    codes = torch.round(xf / _along(scale, axis, x.dim())) + _along(zero_point, axis, x.dim())
    return codes.clamp(qmin, qmax).to(torch.int8), scale, zero_point


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | int = 0,
               axis: int | None = None) -> torch.Tensor:
    """``(q - zero_point) * scale`` in fp32, with per-channel parameters broadcast along ``axis``."""
    if axis is not None:
        axis = axis % q.dim()
    zp = torch.as_tensor(zero_point, dtype=torch.int32, device=q.device)
    if zp.dim():
        zp = _along(zp, axis, q.dim())
    return (q.to(torch.int32) - zp).float() * _along(scale, axis, q.dim())


def quantize_per_channel_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``w`` with one scale per output channel (row, dimension 0).

    ``scale[c] = max |w[c]| / 127`` in fp32 (1 for an all-zero row), ``q = round(w / scale)``
    (to nearest, ties to even as ``torch.round``), clamped to [-127, 127]; ``q`` is int8 with
    ``w``'s shape, ``scale`` fp32 with one entry per row.
    """
    ### BEGIN SOLUTION
    flat = w.detach().float().reshape(w.shape[0], -1)
    absmax = flat.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))
    q = torch.round(flat / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale
    ### END SOLUTION


def check_per_channel(q, scale, w: torch.Tensor, name: str = "quantize_per_channel") -> None:
    """Raise ``checks.MismatchError`` unless ``(q, scale)`` is the symmetric per-channel int8 of ``w``.

    Scales must match ``max |w[c]| / 127`` to fp32 rounding. A code may differ by one from the
    reference only where ``w / scale`` sits within 1e-3 of a half-way point, where dividing or
    multiplying by the reciprocal, or rounding ties away from zero rather than to even, legitimately
    land on either neighbour. An all-zero row may have any positive scale, with codes 0.
    """
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise checks.MismatchError(f"{name}: expected two tensors (q, scale), got "
                                   f"{type(q).__name__} and {type(scale).__name__}")
    if q.dtype != torch.int8 or tuple(q.shape) != tuple(w.shape):
        raise checks.MismatchError(f"{name}: q must be int8 of shape {tuple(w.shape)}, got {q.dtype} "
                                   f"{tuple(q.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (w.shape[0],):
        raise checks.MismatchError(f"{name}: scale must be float32 of shape ({w.shape[0]},), got "
                                   f"{scale.dtype} {tuple(scale.shape)}")
    q, scale = q.detach().cpu(), scale.detach().cpu()
    flat = w.detach().float().cpu().reshape(w.shape[0], -1)
    absmax = flat.abs().amax(dim=1)
    zero_rows = absmax == 0
    if not (torch.isfinite(scale) & (scale > 0))[zero_rows].all():
        raise checks.MismatchError(f"{name}: an all-zero row needs a finite positive scale")
    checks.assert_close(torch.where(zero_rows, absmax, scale), absmax / 127, atol=0.0, rtol=2e-7,
                        name=f"{name} scale")
    safe = torch.where(zero_rows, torch.ones_like(absmax), absmax / 127)
    exact = flat / safe[:, None]
    want = torch.round(exact).clamp(-127, 127)
    got = q.reshape(flat.shape).float()
    near_tie = (exact - exact.floor() - 0.5).abs() < 1e-3
    bad = (got != want) & ~(near_tie & ((got - want).abs() == 1))
    if bad.any():
        raise checks.MismatchError(checks.mismatch_report(got.masked_fill(~bad, 0), want.masked_fill(~bad, 0),
                                                          0.0, 0.0, name=f"{name} q"))


def dynamic_activation_scale(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """One symmetric scale per row of ``x`` (``x.shape[:-1]``), from the row's own absmax.

    Activations are not known ahead of time and one outlier token would flatten every other
    token's codes under a shared scale, so W8A8 inference takes a scale per token as it goes.
    """
    _, qmax = qrange(bits)
    absmax = x.detach().float().abs().amax(dim=-1)
    return torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))


def quantize_activation(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 codes of ``x`` with ``dynamic_activation_scale``'s per-row scales."""
    qmin, qmax = qrange(bits)
    scale = dynamic_activation_scale(x, bits)
    q = torch.round(x.detach().float() / scale[..., None]).clamp(qmin, qmax).to(torch.int8)
    return q, scale


def quantization_error(w: torch.Tensor, *, bits: int = 8, symmetric: bool = True,
                       axis: int | None = None) -> dict[str, float]:
    """Round-trip error of ``quantize`` then ``dequantize`` on ``w``.

    ``max_abs``: the worst element; ``rel_fro``: ``||w - w_hat||_F / ||w||_F``; ``sqnr_db``: the
    signal-to-quantisation-noise ratio (each bit buys about 6 dB when the scale fits the data).
    """
    q, scale, zero_point = quantize(w, bits=bits, symmetric=symmetric, axis=axis)
    wf = w.detach().double()
    diff = dequantize(q, scale, zero_point, axis).double() - wf
    noise, signal = float(diff.norm()), float(wf.norm())
    return {"max_abs": float(diff.abs().max()), "rel_fro": noise / signal if signal else 0.0,
            "sqnr_db": 20 * math.log10(signal / noise) if noise else math.inf}


def channel_errors(w: torch.Tensor, bits: int = 8) -> dict[str, torch.Tensor]:
    """Each output channel's (row's) relative round-trip error, ``||w_c - w_hat_c|| / ||w_c||``,
    with one scale for the whole tensor (``"per tensor"``) and one per row (``"per channel"``)."""
    rows = w.detach().double().reshape(w.shape[0], -1)
    norms = rows.norm(dim=1).clamp(min=torch.finfo(torch.float64).tiny)
    out = {}
    for name, axis in (("per tensor", None), ("per channel", 0)):
        q, scale, zero_point = quantize(w, bits=bits, symmetric=True, axis=axis)
        back = dequantize(q, scale, zero_point, axis).double().reshape(rows.shape)
        out[name] = (back - rows).norm(dim=1) / norms
    return out


def plot_channel_errors(w: torch.Tensor, bits: int = 8):
    """Per-row relative error of per-tensor and per-channel quantisation, rows ordered by their
    norm (smallest left), on a log scale. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    errors = channel_errors(w, bits)
    order = w.detach().reshape(w.shape[0], -1).norm(dim=1).argsort()
    fig, ax = plt.subplots(figsize=(6, 3))
    for name, err in errors.items():
        ax.plot(err[order].numpy(), marker=".", linestyle="none", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("output channel, by the norm of its weights (smallest left)")
    ax.set_ylabel(f"int{bits} relative error")
    ax.legend()
    fig.tight_layout()
    return fig


@contextlib.contextmanager
def one_thread():
    """Run PyTorch ops on one thread inside the block (the previous count is restored after).

    The small models of this lab gain nothing from a second thread on 64-wide matrices, and on a
    shared 2-core machine every op then waits for a busy core: measured 20-38 s for one
    ``qat.experiment`` with two threads against 3-4 s with one, to the same results.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# The regression task of ``train_regression_mlp``: input features whose scales span two decades,
# as un-normalised measurements do, all of which the target depends on.
REGRESSION = {"d_in": 32, "width": 128, "d_out": 16, "n": 4096, "decades": 2.0, "steps": 300, "batch": 256,
              "lr": 3e-3, "weight_decay": 0.05}


def train_regression_mlp(seed: int = 0, steps: int = REGRESSION["steps"]) -> nn.Sequential:
    """Linear -> BatchNorm1d -> ReLU -> Linear trained (AdamW) on a seeded regression, in eval mode.

    The target is ``tanh(z @ T)`` of standard-normal ``z``, but the network sees ``z`` with each
    feature multiplied by a scale between 0.1 and 10: to use the small features it must amplify
    them. That gives the trained layer's channels (and far more so the channels of the layer with
    its BatchNorm folded in, as deployment does before quantising) ranges that differ from one
    another, which a freshly initialised layer's do not.
    """
    spec = REGRESSION
    gen = checks.generator(seed)
    feature_scale = torch.logspace(-spec["decades"] / 2, spec["decades"] / 2, spec["d_in"])
    feature_scale = feature_scale[torch.randperm(spec["d_in"], generator=gen)]
    z = torch.randn(spec["n"], spec["d_in"], generator=gen)
    y = torch.tanh(z @ (torch.randn(spec["d_in"], spec["d_out"], generator=gen) / spec["d_in"] ** 0.5))
    x = z * feature_scale
    model = nn.Sequential(nn.Linear(spec["d_in"], spec["width"]), nn.BatchNorm1d(spec["width"]), nn.ReLU(),
                          nn.Linear(spec["width"], spec["d_out"]))
    with torch.no_grad():
        for layer in (model[0], model[3]):
            bound = layer.in_features ** -0.5
            layer.weight.uniform_(-bound, bound, generator=gen)
            layer.bias.uniform_(-bound, bound, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    with one_thread():
        for _ in range(steps):
            batch = torch.randint(0, spec["n"], (spec["batch"],), generator=gen)
            loss = F.mse_loss(model(x[batch]), y[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model.eval()


def trained_layer(seed: int = 0, steps: int = REGRESSION["steps"]) -> torch.Tensor:
    """The first Linear's weight (128 x 32) of ``train_regression_mlp(seed, steps)``: a real layer
    to compare per-tensor with per-channel scales on."""
    return train_regression_mlp(seed, steps)[0].weight.detach().clone()


def row_range_ratio(w: torch.Tensor) -> float:
    """Largest over smallest per-row absmax of ``w``: how much one per-tensor scale wastes on the
    rows with the smallest range (1 means nothing, per-channel scales gain nothing)."""
    absmax = w.detach().abs().reshape(w.shape[0], -1).amax(dim=1)
    return float(absmax.max() / absmax.min())
