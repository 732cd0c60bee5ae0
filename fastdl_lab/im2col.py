"""Convolution as a matrix multiply (lab 01 gemm): im2col, then one GEMM.

A 2-D convolution of ``C`` input channels with ``O`` filters of ``KH x KW`` is, at every output
pixel, a dot product of the filter with the ``C * KH * KW`` input values under it. Copy those
values out as one column per output pixel (**im2col**) and the whole layer is one matrix product,
``(O, C*KH*KW) @ (C*KH*KW, OH*OW)`` per image, which is how the GEMM of this lab runs
convolutions. The price is memory: every input value is copied into up to ``KH * KW`` columns.

- ``conv2d_ref``: ``torch.nn.functional.conv2d``, the reference;
- ``im2col``: the unrolled input, ``(N, C*KH*KW, OH*OW)``, built from ``KH * KW`` strided slices;
- ``conv2d_im2col``: im2col then ``torch.matmul``, with stride, padding and a bias;
- ``im2col_expansion``: elements of the unrolled matrix per element of the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pair(v) -> tuple[int, int]:
    pair = (v, v) if isinstance(v, int) else tuple(v)
    if len(pair) != 2 or not all(isinstance(x, int) for x in pair):
        raise ValueError(f"expected an int or a pair of ints, got {v!r}")
    return pair


def output_size(h: int, w: int, kernel_size, stride=1, padding=0) -> tuple[int, int]:
    """Output height and width of a convolution (no dilation), the arithmetic ``F.conv2d`` uses."""
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel_size), _pair(stride), _pair(padding)
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"a {kh}x{kw} kernel does not fit a {h}x{w} input with padding {(ph, pw)}")
    return oh, ow


def conv2d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
               padding=0) -> torch.Tensor:
    """PyTorch's own convolution (cuDNN on a GPU, oneDNN or a direct loop on a CPU)."""
    return F.conv2d(x, weight, bias, stride=stride, padding=padding)


def im2col(x: torch.Tensor, kernel_size, stride=1, padding=0) -> torch.Tensor:
    """The columns of ``x`` (N, C, H, W) under a ``kernel_size`` window: ``(N, C*KH*KW, OH*OW)``.

    Row ``c*KH*KW + i*KW + j`` holds input channel ``c`` at kernel offset ``(i, j)`` for every output
    pixel, the order a ``(O, C, KH, KW)`` weight flattens to, so the filters multiply it directly.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be N x C x H x W, got shape {tuple(x.shape)}")
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel_size), _pair(stride), _pair(padding)
    n, c, h, w = x.shape
    oh, ow = output_size(h, w, (kh, kw), (sh, sw), (ph, pw))
    padded = F.pad(x, (pw, pw, ph, ph))
    # One strided slice per kernel offset: slice (i, j) is the input pixel that offset sees at
    # every output position. KH*KW slices, each as large as the output: the copies im2col costs.
    slices = [padded[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]
              for i in range(kh) for j in range(kw)]
    cols = torch.stack(slices, dim=2)  # N, C, KH*KW, OH, OW
    return cols.reshape(n, c * kh * kw, oh * ow)


def conv2d_im2col(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride=1,
                  padding=0) -> torch.Tensor:
    """``F.conv2d(x, weight, bias, stride, padding)`` as im2col and one matrix product per batch."""
    if weight.dim() != 4 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be O x C x KH x KW with C={x.shape[1]}, got {tuple(weight.shape)}")
    o, _, kh, kw = weight.shape
    oh, ow = output_size(x.shape[2], x.shape[3], (kh, kw), stride, padding)
    cols = im2col(x, (kh, kw), stride, padding)
    # (O, C*KH*KW) @ (N, C*KH*KW, OH*OW) broadcasts over the batch: N GEMMs with the filters shared.
    out = torch.matmul(weight.reshape(o, -1), cols)
    if bias is not None:
        out = out + bias[:, None]
    return out.reshape(x.shape[0], o, oh, ow)


def im2col_expansion(h: int, w: int, kernel_size, stride=1, padding=0) -> float:
    """Elements of the unrolled matrix per input element: ``KH*KW * OH*OW / (H*W)``, about
    ``KH*KW / stride**2`` for a 'same' convolution."""
    (kh, kw) = _pair(kernel_size)
    oh, ow = output_size(h, w, kernel_size, stride, padding)
    return kh * kw * oh * ow / (h * w)


def check() -> None:
    """im2col convolutions against ``F.conv2d`` over strides, paddings and rectangular kernels."""
    from fastdl_lab import checks

    for (n, c, h, w), (o, kh, kw), stride, padding in [
        ((2, 3, 9, 11), (4, 3, 3), 1, 1), ((1, 5, 8, 8), (6, 1, 1), 1, 0), ((3, 2, 13, 10), (5, 3, 2), 2, (1, 0)),
    ]:
        x = checks.randn(n, c, h, w, seed=h)
        weight, bias = checks.randn(o, c, kh, kw, seed=w), checks.randn(o, seed=o)
        checks.assert_close(conv2d_im2col(x, weight, bias, stride, padding),
                            conv2d_ref(x, weight, bias, stride, padding), name=f"conv {kh}x{kw} stride {stride}")
    print("im2col: checks passed")


if __name__ == "__main__":
    check()
