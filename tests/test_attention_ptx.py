"""Lab 05 attention: every kernel compiles to PTX for Ampere and Hopper, no GPU needed."""

import pytest
import torch

from fastdl_lab import attention, device, triton_aot

# The kernels holding a matrix product; the preprocess kernel is a row reduction.
MATMUL_KERNELS = ["fwd", "bwd_dkdv", "bwd_dq"]


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("which", sorted(attention.KERNELS))
def test_kernels_compile(capability, which):
    ptx = attention.ptx(capability, torch.float16, which=which, causal=True)
    assert f".target sm_{capability}" in ptx
    summary = triton_aot.ptx_summary(ptx)
    assert summary["global_loads"] > 0 and summary["global_stores"] > 0
    # The score and gradient tiles are tensor-core products: mma.sync on Ampere, wgmma on Hopper.
    tensor_core_ops = summary["mma"] + summary["wgmma"]
    assert (tensor_core_ops > 0) == (which in MATMUL_KERNELS)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float32, 128), (torch.float16, 32)])
@pytest.mark.parametrize("which", MATMUL_KERNELS)
def test_other_types_and_head_dims_compile(which, dtype, head_dim):
    # bf16 is refused under the interpreter, so compiling it is the CPU-side evidence.
    assert ".target sm_90" in attention.ptx(90, dtype, which=which, head_dim=head_dim)


@pytest.mark.interpret
def test_kernels_compile_after_running_under_the_interpreter():
    q, k, v = (torch.randn(1, 1, 40, 32, requires_grad=True) for _ in range(3))
    if device.interpreting():
        attention.flash_attention(q, k, v, causal=True, block_m=16, block_n=16).sum().backward()
    for which in attention.KERNELS:
        assert ".target sm_80" in attention.ptx(80, torch.float16, which=which, head_dim=32)
    if device.interpreting():
        o = attention.flash_attention(q, k, v)
        attention.check_attention(o, q.detach(), k.detach(), v.detach())


def test_ptx_arguments_are_checked():
    with pytest.raises(ValueError, match="which"):
        attention.ptx(90, which="bwd")
    with pytest.raises(ValueError, match="head_dim"):
        attention.ptx(90, head_dim=48)
