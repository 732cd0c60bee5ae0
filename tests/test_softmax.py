"""Lab 02 fusion: the fused softmax kernel against the reference, the launcher's checks, byte counts."""

import pytest
import torch

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import checks, softmax

DEV = "cuda" if device.has_gpu() else "cpu"

# One element, ragged rows in one block, an exact block, and rows past the CPU's default block cap
# (1024), which span two blocks.
SHAPES = [(1, 1), (37, 45), (64, 128), (130, 70), (3, 1500)]


def _input(m, n, dtype=torch.float32, seed=0, scale=1.0):
    return checks.randn(m, n, dtype=dtype, seed=seed, device=DEV, scale=scale)


@pytest.mark.interpret
@pytest.mark.parametrize("m, n", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_matches_reference(m, n, dtype):
    x = _input(m, n, dtype, scale=3.0)
    y = softmax.softmax(x)
    assert y.shape == (m, n) and y.dtype == dtype
    softmax.check_softmax(y, x, name=f"{m}x{n} {dtype}")


@pytest.mark.interpret
@pytest.mark.parametrize("n", [17, 1000, 1025, 2500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_pass_rows_and_online_rows_past_the_cpu_block(n, dtype):
    # Rows of up to 1024 (the interpreter's largest block) take the one-pass branch, longer ones
    # the online one, over two and three blocks.
    assert (softmax.default_config(n, dtype, None)["block_n"] >= n) == (n <= softmax.MAX_BLOCK["cpu"])
    x = _input(3, n, dtype, seed=n, scale=5.0)
    softmax.check_softmax(softmax.softmax(x), x, name=f"3x{n} {dtype}")


@pytest.mark.interpret
@pytest.mark.parametrize("m, n, block_n", [(5, 17, 16), (7, 257, 32), (4, 300, 16), (3, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rows_spanning_many_blocks(m, n, block_n, dtype):
    x = _input(m, n, dtype, seed=1, scale=4.0)
    softmax.check_softmax(softmax.softmax(x, block_n=block_n), x, name=f"{m}x{n} in blocks of {block_n}")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_large_values_and_minus_infinity(dtype):
    x = _input(8, 200, torch.float32, seed=2, scale=1e4)
    drop = torch.rand(8, 200, generator=checks.generator(3)) < 0.3
    x = x.masked_fill(drop.to(DEV), float("-inf"))
    # Whole blocks of -inf at the start of a row: the running max stays -inf for several blocks.
    x[:, :50] = float("-inf")
    x[:, -1] = 0.0
    x = x.to(dtype)
    y = softmax.softmax(x, block_n=16)
    assert y.isfinite().all()
    assert (y[:, :50] == 0).all()
    softmax.check_softmax(y, x, name="large and -inf")


@pytest.mark.interpret
def test_rows_with_a_stride_and_empty_inputs():
    x = _input(12, 200, seed=4)[:, 30:170]
    assert x.stride(0) == 200
    softmax.check_softmax(softmax.softmax(x, block_n=64), x)
    assert softmax.softmax(_input(0, 5)).shape == (0, 5)
    assert softmax.softmax(_input(3, 0)).shape == (3, 0)


def test_eager_steps_and_reference_agree():
    x = _input(9, 31, seed=5, scale=5.0)
    checks.assert_close(softmax.softmax_eager_steps(x), softmax.softmax_ref(x))
    checks.assert_close(softmax.softmax_ref(x).sum(dim=-1), torch.ones(9, device=DEV))
    assert softmax.softmax_ref(x.half()).dtype == torch.float16


def _block(n_cols, dtype=torch.float32, capability=None):
    return softmax.default_config(n_cols, dtype, capability)["block_n"]


def test_default_block_is_capped_by_dtype_and_device():
    assert _block(1) == 16
    assert _block(45) == 64
    assert _block(1500) == softmax.MAX_BLOCK["cpu"]
    assert _block(1500, capability=90) == 2048
    assert _block(50_000, capability=90) == 4096
    # 16-bit rows of 8192 are a single block on the GPU, so read from memory once.
    for capability in (80, 90):
        assert _block(8192, torch.float16, capability) == _block(8192, torch.bfloat16, capability) == 8192
        assert _block(8193, torch.float16, capability) == 8192
    assert softmax.default_config(8192, torch.float16, 90)["num_warps"] == 16


@pytest.mark.parametrize("x, message", [
    (torch.zeros(4), "2-D"),
    (torch.zeros(2, 3, 4), "2-D"),
    (torch.zeros(4, 4, dtype=torch.int32), "not supported"),
    (torch.zeros(4, 6).t(), "contiguous last dimension"),
])
def test_validation_messages(x, message):
    with pytest.raises(ValueError, match=message):
        softmax.softmax(x.to(DEV))


def test_validation_of_types_and_blocks():
    with pytest.raises(TypeError):
        softmax.softmax([[1.0, 2.0]])
    x = _input(4, 40)
    for bad in (8, 48, 0):
        with pytest.raises(ValueError, match="power of two"):
            softmax.softmax(x, block_n=bad)


@pytest.mark.skipif(not device.interpreting(), reason="bf16 is only refused under the interpreter")
def test_bf16_refused_under_interpreter():
    with pytest.raises(ValueError, match="bfloat16"):
        softmax.softmax(torch.zeros(4, 4, dtype=torch.bfloat16))


@triton.jit
def _skips_odd_rows(x_ptr, y_ptr, n_cols, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    # A plausible bug: a grid-stride loop with the wrong step writes every other row only.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=mask & (row % 2 == 0))


@pytest.mark.interpret
@pytest.mark.skipif(device.has_gpu(), reason="outputs are poisoned on the CPU path only")
def test_unwritten_rows_are_caught():
    x = _input(6, 20, seed=6)
    y = softmax.softmax(x, kernel=_skips_odd_rows)
    assert y[0::2].isfinite().all() and y[1::2].isnan().all()
    with pytest.raises(checks.MismatchError, match="NaN in actual"):
        softmax.check_softmax(y, x)


def test_byte_counts_follow_the_contract():
    # 2 x 3 fp32: naive 8*6 + 4*2 = 56 elements, fused 12.
    assert softmax.softmax_bytes_ref(2, 3, 4) == (224, 48)
    assert softmax.softmax_bytes_ref(1, 1, 2) == (24, 4)
    assert softmax.softmax_bytes_ref(0, 7, 4) == (0, 0)
    naive, fused = softmax.softmax_bytes_ref(4096, 4096, 2)
    assert naive == (8 * 4096 * 4096 + 4 * 4096) * 2 and fused == 2 * 4096 * 4096 * 2
    # 4 + 2/N: long rows make the five-op version move four times the bytes it needs.
    assert naive / fused == 4 + 2 / 4096
