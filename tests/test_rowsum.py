"""Lab 01 warm-up: the row-sum kernel on ragged, padded and transposed inputs, its check's rule,
the launcher's validation, and what the compiler makes of a known unit stride."""

import pytest
import torch

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import checks, rowsum

DEV = "cuda" if device.has_gpu() else "cpu"


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, blocks", [
    (1, 1, {}), (37, 300, {}), (130, 77, {"block_m": 16, "block_n": 16}), (3, 5, {"block_m": 1, "block_n": 2}),
])
def test_row_sum_matches_reference(m, n, blocks, dtype):
    x = checks.randn(m, n, dtype=dtype, seed=m * n, device=DEV)
    y = rowsum.row_sum(x, **blocks)
    assert y.shape == (m,) and y.dtype == dtype
    rowsum.check_row_sum(y, x)


@pytest.mark.interpret
def test_strided_views_and_empty_rows():
    base = checks.randn(40, 100, seed=1, device=DEV)
    for x in (base[3:, 7:90], base.t(), base[::3, ::2], base[:, :0]):
        rowsum.check_row_sum(rowsum.row_sum(x, block_m=8, block_n=32), x)
    assert rowsum.row_sum(base[:0]).shape == (0,)


@triton.jit
def _no_column_mask(x_ptr, y_ptr, M, N, stride_xm, stride_xn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        ptrs = x_ptr + rows[:, None] * stride_xm + (start + cols)[None, :] * stride_xn
        acc += tl.sum(tl.load(ptrs, mask=rows[:, None] < M, other=0.0), axis=1)
    tl.store(y_ptr + rows, acc, mask=rows < M)


@pytest.mark.interpret
def test_a_missing_column_mask_is_caught():
    # Inside a wider buffer the overrun reads the padding (NaN here): the values give it away.
    wide = torch.full((10, 80), float("nan"), device=DEV)
    wide[:8, :40] = checks.randn(8, 40, seed=2, device=DEV)
    x = wide[:8, :40]
    with pytest.raises(checks.MismatchError, match="NaN in actual"):
        rowsum.check_row_sum(rowsum.row_sum(x, kernel=_no_column_mask, block_m=8, block_n=32), x)
    if device.interpreting():
        # A plain matrix: the last row's overrun leaves the tensor, which the checked interpreter stops.
        from fastdl_lab.bounds import OutOfBoundsAccess

        plain = checks.randn(8, 40, seed=3)
        with pytest.raises(OutOfBoundsAccess, match="x_ptr"):
            rowsum.row_sum(plain, kernel=_no_column_mask, block_m=8, block_n=32)


def test_check_allows_any_summation_order_but_not_a_lost_element():
    x = checks.randn(16, 2000, seed=4)
    # Summed one element after the other from the end of each row, in fp32.
    reordered = x.flip(1).cumsum(1)[:, -1]
    rowsum.check_row_sum(reordered, x)
    dropped = x[:, 1:].sum(1)
    with pytest.raises(checks.MismatchError):
        rowsum.check_row_sum(dropped, x)
    # 16-bit accumulation over long rows is outside the rule for fp16.
    h = checks.randn(4, 2000, dtype=torch.float16, seed=5, scale=4.0)
    running = torch.zeros(4, dtype=torch.float16)
    for j in range(h.shape[1]):
        running = running + h[:, j]
    with pytest.raises(checks.MismatchError):
        rowsum.check_row_sum(running, h)


@pytest.mark.parametrize("x, kwargs, error, message", [
    (torch.zeros(4), {}, ValueError, "2-D"),
    (torch.zeros(4, 4, dtype=torch.int32), {}, ValueError, "not supported"),
    ([[1.0]], {}, TypeError, "torch.Tensor"),
    (torch.zeros(4, 4), {"block_n": 48}, ValueError, "power of two"),
    (torch.zeros(4, 4), {"block_m": 0}, ValueError, "power of two"),
])
def test_validation(x, kwargs, error, message):
    with pytest.raises(error, match=message):
        rowsum.row_sum(x.to(DEV) if isinstance(x, torch.Tensor) else x, **kwargs)


def test_a_known_unit_stride_gives_vector_loads():
    contiguous = rowsum.ptx(90, torch.float32, contiguous=True)
    strided = rowsum.ptx(90, torch.float32, contiguous=False)
    assert ".reqntid 128" in contiguous
    assert "ld.global.v4.b32" in contiguous and "ld.global.v4" not in strided
    # 4 x 512 values over 128 threads: 16 per thread, in 4 vector loads or 16 single ones.
    assert contiguous.count("ld.global") == 4 and strided.count("ld.global") == 16
