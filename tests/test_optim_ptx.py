"""Lab 04 mixed precision: the fused AdamW kernel compiles to PTX for Ampere and Hopper, no GPU needed."""

import pytest
import torch

from fastdl_lab import checks, device, optim, triton_aot


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("has_master", [False, True])
def test_kernel_compiles(capability, dtype, has_master):
    ptx = optim.ptx(capability, dtype, has_master)
    assert f".target sm_{capability}" in ptx
    summary = triton_aot.ptx_summary(ptx)
    assert summary["global_loads"] > 0 and summary["global_stores"] > 0
    # An optimizer step is elementwise: nothing should have reached the tensor cores.
    assert summary["mma"] == summary["wgmma"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_master_adds_a_store_and_params_move_as_16_bit(dtype):
    without, with_master = optim.ptx(90, dtype, False), optim.ptx(90, dtype, True)
    # The master is written back besides m, v and the param itself.
    assert triton_aot.ptx_summary(with_master)["global_stores"] > triton_aot.ptx_summary(without)["global_stores"]
    for ptx in (without, with_master):
        assert "st.global.b16" in ptx and "ld.global.b16" in ptx


@pytest.mark.parametrize("capability", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_chunks_move_as_16_byte_vectors_when_the_addresses_are_aligned(capability, dtype):
    aligned, general = optim.ptx(capability, dtype, True), optim.ptx(capability, dtype, True, aligned=False)
    # 1024 elements on 4 warps: 8 a thread, two 16-byte vectors of fp32, one of a 16-bit dtype.
    # Read: master, m, v (fp32) and the grad; written: m, v, master and the param.
    expected = 3 * 2 + (2 if dtype == torch.float32 else 1)
    assert aligned.count("ld.global.v4.b32") == aligned.count("st.global.v4.b32") == expected
    # Without the alignment the launcher vouches for, the compiler sees none in an address read
    # from a table: every access is a scalar one.
    assert ".v4." not in general and ".v2." not in general


@pytest.mark.interpret
def test_kernel_compiles_after_running_under_the_interpreter():
    params = [checks.randn(5, 7), checks.randn(300)]
    if device.interpreting():
        moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
        optim.fused_adamw(params, [torch.ones_like(p) for p in params], *moments, 1, lr=1e-2, beta1=0.9,
                          beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert ".target sm_80" in optim.ptx(80, torch.float32)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="dtype"):
        optim.ptx(90, torch.float64)
