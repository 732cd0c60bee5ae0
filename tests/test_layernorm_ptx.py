"""Lab 03 layernorm: all three kernels compile to PTX for Ampere and Hopper, no GPU needed."""

import pytest
import torch

from fastdl_lab import device, layernorm, triton_aot

KERNELS = ["fwd", "bwd_dx", "bwd_dwdb"]


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("which", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernels_compile(capability, which, dtype):
    ptx = layernorm.ptx(capability, dtype, which=which)
    assert f".target sm_{capability}" in ptx
    summary = triton_aot.ptx_summary(ptx)
    assert summary["global_loads"] > 0 and summary["global_stores"] > 0
    # A normalisation has no matrix product: nothing should have reached the tensor cores.
    assert summary["mma"] == summary["wgmma"] == 0


def test_forward_row_loads_are_vectorised():
    # Rows of a multiple of 16 elements, 1024 per block over 4 warps: 8 fp16 values per thread,
    # which the aligned launch lets the compiler fetch with one 128-bit load.
    assert "ld.global.v4.b32" in layernorm.ptx(90, torch.float16, which="fwd")


@pytest.mark.parametrize("which", KERNELS)
def test_bf16_compiles_for_hopper(which):
    # bf16 is refused under the interpreter, so compiling it is the CPU-side evidence.
    assert ".target sm_90" in layernorm.ptx(90, torch.bfloat16, which=which)


@pytest.mark.interpret
def test_kernels_compile_after_running_under_the_interpreter():
    x = torch.randn(5, 40, requires_grad=True)
    w, b = torch.ones(40, requires_grad=True), torch.zeros(40, requires_grad=True)
    if device.interpreting():
        layernorm.layer_norm(x, w, b).sum().backward()
    for which in KERNELS:
        assert ".target sm_80" in layernorm.ptx(80, torch.float32, which=which)
    if device.interpreting():
        y = layernorm.layer_norm(x, w, b)
        layernorm.check_layer_norm(y, x.detach(), w.detach(), b.detach())


def test_unknown_kernel_name():
    with pytest.raises(ValueError, match="which"):
        layernorm.ptx(90, which="bwd")
