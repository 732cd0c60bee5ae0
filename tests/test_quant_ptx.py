"""Lab 09: the int8 matmul kernel compiles for Ampere and Hopper and reaches the integer tensor cores."""

import re

import pytest

from fastdl_lab import checks, device, quant, triton_aot

# The integer MMA each architecture offers: Ampere's warp-level mma.sync with int8 operands and
# int32 accumulators (m16n8k32), Hopper's warpgroup wgmma (m64nNk32).
INT8_MMA = {
    80: r"mma\.sync\.aligned\.m16n8k32\.row\.col(\.satfinite)?\.s32\.s8\.s8\.s32",
    90: r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8",
}


def _mma_instructions(ptx: str) -> set[str]:
    return set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*", ptx))


@pytest.mark.parametrize("capability", [80, 90])
def test_kernel_reaches_the_int8_tensor_cores(capability):
    ptx = quant.ptx(capability)
    assert re.search(rf"^\.target sm_{capability}a?\b", ptx, re.MULTILINE)
    found = _mma_instructions(ptx)
    # Every MMA is the integer one: no operand was widened to a float format on the way.
    assert found and all(re.fullmatch(INT8_MMA[capability], name) for name in found), found
    summary = triton_aot.ptx_summary(ptx)
    assert summary["mma" if capability == 80 else "wgmma"] > 0
    # Operand tiles stream into shared memory asynchronously (the software-pipelined K loop).
    assert summary["async_copies"] > 0 and summary["global_stores"] > 0
    # The epilogue converts the int32 sums to fp32 once per output, and stores fp32.
    assert "cvt.rn.f32.s32" in ptx and "st.global.v4.b32" in ptx


def test_ampere_mma_saturates_instead_of_wrapping():
    # Why the launcher bounds K: on overflow sm_80 would clamp where the interpreter wraps.
    assert ".satfinite" in "".join(_mma_instructions(quant.ptx(80)))


@pytest.mark.interpret
def test_kernel_compiles_after_running_under_the_interpreter():
    if device.interpreting():
        a_q, a_scale = quant.quantize_activation(checks.randn(20, 70, seed=1))
        w_q, w_scale, _ = quant.quantize(checks.randn(30, 70, seed=2), axis=0)
        quant.check_int8_matmul(quant.int8_matmul(a_q, a_scale, w_q, w_scale), a_q, a_scale, w_q, w_scale)
    assert _mma_instructions(quant.ptx(90, block_m=64, block_n=64, block_k=64))


class _Launch:
    """Stands in for a kernel to record what the launcher passes: ``kernel[grid](*args, **kwargs)``."""

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.grid, self.args, self.kwargs = grid, args, kwargs
        return record


def test_a_launch_from_the_launcher_compiles_as_the_grader_compiles_it():
    # The grader proves a student's kernel is one by compiling it for the launch it is given.
    # More rows than one tile holds at any configuration (128 on a GPU, 64 under the interpreter).
    a_q, a_scale = quant.quantize_activation(checks.randn(200, 70, seed=1))
    w_q, w_scale, _ = quant.quantize(checks.randn(30, 70, seed=2), axis=0)
    launch = _Launch()
    dev = "cuda" if device.has_gpu() else "cpu"
    quant.int8_matmul(*(t.to(dev) for t in (a_q, a_scale, w_q, w_scale)), kernel=launch)
    assert len(launch.grid) == 2 and launch.grid[0] * launch.grid[1] >= 2
    ptx = triton_aot.compile_launch(quant._int8_matmul_kernel, launch.args, launch.kwargs, capability=90)
    assert _mma_instructions(ptx)
