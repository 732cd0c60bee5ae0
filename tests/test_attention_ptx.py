"""Lab 05 attention: every kernel compiles for Ampere and Hopper at the configuration its launcher
uses there, reaches the tensor cores, spills nothing and fits the SM's shared memory; no GPU needed."""

import pytest
import torch

from fastdl_lab import attention, device, kernel_report, triton_aot

# The kernels holding a matrix product; the preprocess kernel is a row reduction.
MATMUL_KERNELS = ["fwd", "bwd_dkdv", "bwd_dq"]
SHARED_LIMIT = kernel_report.SHARED_LIMIT


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("which", sorted(attention.KERNELS))
def test_kernels_compile_at_the_launch_configuration(capability, which):
    kernel = attention.compiled(capability, torch.float16, which=which, head_dim=64, causal=True)
    config = attention.default_config(64, torch.float16, capability)
    prefix = "" if which == "fwd" else "bwd_"
    assert kernel.metadata.num_warps == config[f"{prefix}num_warps"]
    assert kernel.metadata.num_stages == config[f"{prefix}num_stages"]
    ptx = kernel.asm["ptx"]
    assert f".target sm_{capability}" in ptx
    summary = triton_aot.ptx_summary(ptx)
    assert summary["global_loads"] > 0 and summary["global_stores"] > 0
    # The score and gradient tiles are tensor-core products: mma.sync on Ampere, wgmma on Hopper.
    tensor_core_ops = summary["wgmma"] if capability >= 90 else summary["mma"]
    assert (tensor_core_ops > 0) == (which in MATMUL_KERNELS)
    usage = triton_aot.resources(kernel)
    assert usage["local_bytes"] == usage["stack_bytes"] == 0, f"{which} sm_{capability} spills: {usage}"
    assert usage["shared_bytes"] <= SHARED_LIMIT[capability], f"{which} sm_{capability}: {usage}"


def test_hopper_forward_pipeline_fits_the_largest_head_dim():
    # Three stages on sm_90 hold the most registers and shared memory at head dim 128 (8 warps,
    # the largest q tile and accumulator): it must still spill nothing.
    kernel = attention.compiled(90, torch.float16, which="fwd", head_dim=128, causal=True)
    assert kernel.metadata.num_stages == 3
    usage = triton_aot.resources(kernel)
    assert usage["local_bytes"] == usage["stack_bytes"] == 0 and usage["shared_bytes"] <= SHARED_LIMIT[90], usage


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 64), (torch.float32, 128), (torch.float16, 32)])
@pytest.mark.parametrize("which", MATMUL_KERNELS)
def test_other_types_and_head_dims_compile(which, dtype, head_dim):
    # bf16 is refused under the interpreter, so compiling it is the CPU-side evidence; a ragged
    # length compiles the bounds masks the aligned one drops, and must spill nothing either.
    kernel = attention.compiled(90, dtype, which=which, head_dim=head_dim, causal=False, even_n=False)
    assert ".target sm_90" in kernel.asm["ptx"]
    assert triton_aot.resources(kernel)["stack_bytes"] == triton_aot.resources(kernel)["local_bytes"] == 0


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
    with pytest.raises(ValueError, match="capability"):
        attention.compiled(None)
    with pytest.raises(ValueError, match="dtype"):
        attention.compiled(90, torch.int32)
