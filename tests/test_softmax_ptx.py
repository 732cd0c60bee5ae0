"""Ahead-of-time PTX for the fused softmax: it must compile for Ampere and Hopper, no GPU needed."""

import pytest
import torch

from fastdl_lab import checks, device, softmax, triton_aot


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_compiles_to_vectorised_ptx(capability, dtype):
    ptx = softmax.ptx(capability, dtype)
    assert f".target sm_{capability}" in ptx
    summary = triton_aot.ptx_summary(ptx)
    assert summary["global_loads"] > 0 and summary["global_stores"] > 0
    # Aligned contiguous rows load several values per instruction; tl.exp becomes the fast ex2.
    assert ".v4" in ptx or ".v2" in ptx
    assert "ex2.approx" in ptx


def test_largest_gpu_block_and_bf16_compile_for_hopper():
    # bf16 cannot run under the interpreter, so compiling it is the CPU-side evidence.
    for dtype in (torch.bfloat16, torch.float32):
        assert ".target sm_90" in softmax.ptx(90, dtype, n_cols=softmax.max_block(dtype, 90))


def test_a_row_that_fits_is_read_once_with_one_exp_per_element():
    # Rows of 1024 fp32 values over 4 warps: 8 per thread, two 16-byte loads. The one-pass branch
    # loads the row once and takes each exp once; the online branch reads it twice (2 loads more)
    # and takes each exp twice (16 exps more, and one per block for the rescaling).
    ptx = softmax.ptx(90, torch.float32, n_cols=1024)
    assert ptx.count("ld.global.v4.b32") == 2 + 4
    assert ptx.count("ex2.approx") == 8 + 16 + 1


@pytest.mark.interpret
def test_softmax_compiles_after_running_under_the_interpreter():
    x = checks.randn(5, 300, scale=3.0)
    if device.interpreting():
        softmax.check_softmax(softmax.softmax(x, block_n=64), x)
    assert ".target sm_80" in softmax.ptx(80)
    if device.interpreting():
        softmax.check_softmax(softmax.softmax(x, block_n=64), x)
