"""Depthwise-separable convolution, the building block of MobileNet-style models (lab 09).

A standard ``k x k`` convolution from ``C_in`` to ``C_out`` channels mixes space and channels in
one step: ``C_in * C_out * k * k`` multiply-adds per output pixel. MobileNet (Howard et al., 2017)
splits it in two: a **depthwise** ``k x k`` convolution that filters each input channel on its own
(``groups=C_in``: ``C_in * k * k``), then a **pointwise** ``1 x 1`` convolution that mixes channels
(``C_in * C_out``). The multiply-adds fall by ``1 / C_out + 1 / k**2`` (about 8-9 times fewer for
3 x 3 filters). The time falls by less: a depthwise convolution does ``k * k`` multiply-adds per
value it reads, so it is bound by memory, not by arithmetic, and libraries have fewer tuned
kernels for it than for dense convolution.

- ``conv_flops`` / ``separable_flops``: the arithmetic, FLOPs as 2 per multiply-add;
- ``flop_ratio``: the paper's reduction, ``1 / C_out + 1 / k**2``;
- ``standard_block`` / ``separable_block``: the two layers with seeded weights, same output shape;
- ``batch1_comparison``: both on one image, FLOPs counted by ``FlopCounterMode`` and time A/B.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_flops(c_in: int, c_out: int, h_out: int, w_out: int, k: int, groups: int = 1, batch: int = 1) -> int:
    """FLOPs (2 per multiply-add) of a ``k x k`` convolution with ``groups`` groups, bias left out."""
    if c_in % groups or c_out % groups:
        raise ValueError(f"groups={groups} must divide both channel counts ({c_in}, {c_out})")
    return 2 * batch * h_out * w_out * c_out * (c_in // groups) * k * k


def separable_flops(c_in: int, c_out: int, h_out: int, w_out: int, k: int, batch: int = 1) -> int:
    """FLOPs of a depthwise ``k x k`` convolution then a pointwise ``1 x 1`` one."""
    return (conv_flops(c_in, c_in, h_out, w_out, k, groups=c_in, batch=batch)
            + conv_flops(c_in, c_out, h_out, w_out, 1, batch=batch))


def flop_ratio(c_out: int, k: int) -> float:
    """Separable over standard FLOPs: ``1 / C_out + 1 / k**2`` (independent of ``C_in`` and the image)."""
    return 1 / c_out + 1 / k**2


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p[0].numel() if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return module


def standard_block(c_in: int, c_out: int, k: int = 3, seed: int = 0) -> nn.Module:
    """One ``k x k`` convolution, padded to keep the image size, no bias."""
    return _seeded(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), seed)


def separable_block(c_in: int, c_out: int, k: int = 3, seed: int = 0) -> nn.Sequential:
    """Depthwise ``k x k`` (one filter per input channel) then pointwise ``1 x 1``, no bias."""
    return _seeded(nn.Sequential(nn.Conv2d(c_in, c_in, k, padding=k // 2, groups=c_in, bias=False),
                                 nn.Conv2d(c_in, c_out, 1, bias=False)), seed)


def counted_flops(module: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of ``module(x)`` as PyTorch's ``FlopCounterMode`` counts them."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        module(x)
    return counter.get_total_flops()


def batch1_comparison(c_in: int = 128, c_out: int = 128, size: int = 56, k: int = 3, reps: int = 20,
                      threads: int | None = 1) -> dict:
    """One ``c_in x size x size`` image through the separable and the standard block: FLOPs each
    (counted) and a ``timing.compare`` of the separable one (candidate) against the standard one,
    in ``threads`` threads (one by default: a server runs many requests side by side); and the
    depthwise half's share of the separable block's FLOPs and of its time."""
    from fastdl_lab import checks, timing

    x = checks.randn(1, c_in, size, size, seed=1)
    std, sep = standard_block(c_in, c_out, k), separable_block(c_in, c_out, k)
    flops = {"standard": counted_flops(std, x), "separable": counted_flops(sep, x)}
    depthwise, pointwise = sep
    with torch.inference_mode():
        cmp = timing.compare(lambda: sep(x), lambda: std(x), reps=reps, threads=threads)
        # The two halves of the separable block against each other: where its time goes.
        mid = depthwise(x)
        parts = timing.compare(lambda: depthwise(x), lambda: pointwise(mid), reps=reps, threads=threads)
    dw_flops = counted_flops(depthwise, x)
    dw_time = parts.candidate.median / (parts.candidate.median + parts.baseline.median)
    return {"flops": flops, "flop_ratio": flops["separable"] / flops["standard"], "timing": cmp,
            "time_ratio": cmp.candidate.median / cmp.baseline.median,
            "depthwise_share": {"flops": dw_flops / flops["separable"], "time": dw_time}}


def check() -> None:
    """The formulas equal what PyTorch counts, and the paper's ratio follows from them."""
    c_in, c_out, size, k = 16, 24, 10, 3
    x = torch.randn(1, c_in, size, size)
    assert counted_flops(standard_block(c_in, c_out, k), x) == conv_flops(c_in, c_out, size, size, k)
    assert counted_flops(separable_block(c_in, c_out, k), x) == separable_flops(c_in, c_out, size, size, k)
    ratio = separable_flops(c_in, c_out, size, size, k) / conv_flops(c_in, c_out, size, size, k)
    assert abs(ratio - flop_ratio(c_out, k)) < 1e-12
    print(f"separable: FLOPs as counted; {c_out} outputs, 3 x 3: {1 / ratio:.1f} times fewer")


if __name__ == "__main__":
    check()
