"""Lab 01's convolution as a matrix multiply: im2col + GEMM against F.conv2d over strides, paddings
and rectangular kernels; the column layout against F.unfold; the memory expansion figure."""

import pytest
import torch
import torch.nn.functional as F

from fastdl_lab import checks, im2col


@pytest.mark.parametrize("shape, filters, stride, padding", [
    ((2, 3, 9, 11), (4, 3, 3), 1, 1),
    ((1, 1, 5, 5), (1, 5, 5), 1, 0),  # the kernel covers the whole input: one output pixel
    ((3, 2, 13, 10), (5, 3, 2), 2, (1, 0)),
    ((2, 4, 7, 7), (8, 1, 1), 1, 0),  # 1x1: im2col is a reshape, the layer a plain GEMM
    ((1, 3, 16, 16), (6, 7, 7), (2, 3), 3),
])
def test_conv2d_im2col_matches_f_conv2d(shape, filters, stride, padding):
    n, c, h, w = shape
    o, kh, kw = filters
    x = checks.randn(*shape, seed=h * w)
    weight, bias = checks.randn(o, c, kh, kw, seed=o), checks.randn(o, seed=o + 1)
    for b in (bias, None):
        out = im2col.conv2d_im2col(x, weight, b, stride, padding)
        ref = im2col.conv2d_ref(x, weight, b, stride, padding)
        assert out.shape == ref.shape
        checks.assert_close(out, ref)


def test_columns_are_unfolds_layout():
    x = checks.randn(2, 3, 8, 9, seed=1)
    for kernel_size, stride, padding in [(3, 1, 1), ((2, 4), 2, 0), (1, 1, 0)]:
        cols = im2col.im2col(x, kernel_size, stride, padding)
        assert torch.equal(cols, F.unfold(x, kernel_size, padding=padding, stride=stride))


def test_expansion_is_the_copies_im2col_makes():
    x = torch.zeros(1, 64, 56, 56)
    cols = im2col.im2col(x, 3, 1, 1)
    assert cols.numel() / x.numel() == im2col.im2col_expansion(56, 56, 3, 1, 1) == 9.0
    assert im2col.im2col_expansion(56, 56, 3, 2, 1) == 9 * 28 * 28 / 56**2
    assert im2col.im2col_expansion(7, 7, 1) == 1.0


def test_shapes_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="does not fit"):
        im2col.output_size(4, 4, 5)
    with pytest.raises(ValueError, match="N x C x H x W"):
        im2col.im2col(torch.zeros(3, 8, 8), 3)
    with pytest.raises(ValueError, match="weight"):
        im2col.conv2d_im2col(torch.zeros(1, 3, 8, 8), torch.zeros(4, 2, 3, 3))
