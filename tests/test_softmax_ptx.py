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
    block = softmax.MAX_BLOCK["gpu"]
    assert ".target sm_90" in softmax.ptx(90, torch.bfloat16, block_n=block)
    assert ".target sm_90" in softmax.ptx(90, torch.float32, block_n=block)


@pytest.mark.interpret
def test_softmax_compiles_after_running_under_the_interpreter():
    x = checks.randn(5, 300, scale=3.0)
    if device.interpreting():
        softmax.check_softmax(softmax.softmax(x, block_n=64), x)
    assert ".target sm_80" in softmax.ptx(80)
    if device.interpreting():
        softmax.check_softmax(softmax.softmax(x, block_n=64), x)
