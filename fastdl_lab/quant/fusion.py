"""Inference-time fusion: BatchNorm folded into the Linear before it, and torch.compile (lab 09).

At inference a BatchNorm uses its running statistics, so after a Linear it is one more affine
map per output feature: it folds into the Linear's weight rows and bias, leaving one matmul where
there were two passes. This is lab 02's Conv + BatchNorm folding exactly: a Linear is a 1 x 1
convolution over a 1 x 1 image and a BatchNorm1d over features is a BatchNorm2d over such
images, so ``fold_linear_bn`` hands the pair, viewed that way, to ``fastdl_lab.fusion``'s fold.

Folding is also the first step of deploying a quantised model: the folded rows carry the
BatchNorm's per-channel scales, which is why such layers need per-channel weight scales (see
``formats.row_range_ratio`` before and after folding).

- ``fold_linear_bn`` / ``fold_linear_bn_model``: the fold for one pair, and for every
  Linear -> BatchNorm1d pair of a model (a folded, eval-mode copy);
- ``bn_mlp``: an MLP of Linear -> BatchNorm1d -> ReLU blocks with trained-looking statistics, on
  which ``bench`` times eager, folded and ``torch.compile``d inference (under
  ``torch.inference_mode()``, where no autograd state is recorded for a graph to keep);
- ``forward_ops``: the ops one forward dispatches, what folding saves whatever the clock says.

Under the student copy of the package lab 02's fold is a graded stub: pass ``fold=`` (the fold
written in lab 02) to use these there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fastdl_lab import checks
from fastdl_lab.fusion import fold_adjacent, fold_conv_bn_ref


def fold_linear_bn(linear: nn.Linear, bn: nn.BatchNorm1d, fold: Callable | None = None) -> nn.Linear:
    """A new ``nn.Linear`` (with bias) equal to ``bn(linear(x))`` with ``bn`` in eval mode.

    ``fold(conv, bn2d) -> conv`` is a Conv2d + BatchNorm2d fold (default
    ``fastdl_lab.fusion.fold_conv_bn_ref``); it receives the pair as a 1 x 1 convolution and a
    BatchNorm2d carrying ``bn``'s parameters and statistics.
    """
    if not isinstance(linear, nn.Linear) or not isinstance(bn, nn.BatchNorm1d):
        raise TypeError(f"expected nn.Linear and nn.BatchNorm1d, got {type(linear).__name__} and "
                        f"{type(bn).__name__}")
    fold = fold or fold_conv_bn_ref
    factory = {"device": linear.weight.device, "dtype": linear.weight.dtype}
    conv = nn.Conv2d(linear.in_features, linear.out_features, 1, bias=linear.bias is not None, **factory)
    bn2d = nn.BatchNorm2d(bn.num_features, eps=bn.eps, momentum=bn.momentum, affine=bn.affine,
                          track_running_stats=bn.track_running_stats, **factory)
    with torch.no_grad():
        conv.weight.copy_(linear.weight[:, :, None, None])
        if linear.bias is not None:
            conv.bias.copy_(linear.bias)
    # Same parameter and buffer names in both BatchNorms: the state moves over as it is.
    bn2d.load_state_dict(bn.state_dict())
    folded = fold(conv, bn2d.eval())
    fused = nn.Linear(linear.in_features, linear.out_features, bias=True, **factory)
    with torch.no_grad():
        fused.weight.copy_(folded.weight.reshape(linear.out_features, linear.in_features))
        fused.bias.copy_(folded.bias)
    return fused.eval()


def fold_linear_bn_model(model: nn.Module, fold: Callable | None = None) -> nn.Module:
    """An eval-mode copy of ``model`` with every Linear -> BatchNorm1d pair folded into one Linear.

    As ``fastdl_lab.fusion.fold_model`` for convolutions (``fusion.fold_adjacent``): only pairs
    adjacent inside an ``nn.Sequential``; the BatchNorm becomes ``nn.Identity``.
    """
    return fold_adjacent(model, nn.Linear, nn.BatchNorm1d, lambda linear, bn: fold_linear_bn(linear, bn, fold))


def bn_mlp(d_in: int = 256, width: int = 1024, depth: int = 3, d_out: int = 10, seed: int = 0) -> nn.Sequential:
    """``depth`` blocks of Linear -> BatchNorm1d -> ReLU, then a Linear head, in eval mode.

    Weights, statistics and affine parameters are drawn from ``seed`` as if trained: fresh
    BatchNorms (mean 0, variance 1, gamma 1, beta 0) would make the fold look trivially exact.
    """
    gen = checks.generator(seed)
    layers, features = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.BatchNorm1d(width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, d_out))
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.in_features ** 0.5)
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, nn.BatchNorm1d):
                m.running_mean.copy_(0.2 * torch.randn(m.num_features, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=gen))
                m.weight.copy_(0.5 + torch.rand(m.num_features, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.num_features, generator=gen))
    return model.eval()


def forward_ops(model: nn.Module, x: torch.Tensor) -> int:
    """Torch ops one forward of ``model`` dispatches (lab 06's counter): on a GPU, about one kernel
    launch and one pass over its operands each, so folding a BatchNorm away saves one of each."""
    # Imported here: the rest of lab 06's package (images, loaders) has no business in this one.
    from fastdl_lab.data.syncs import SyncCounter

    with torch.inference_mode(), SyncCounter(x.device) as counter:
        model(x)
    return counter.ops
