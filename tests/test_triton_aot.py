"""Ahead-of-time PTX compilation: the course GEMM must compile for Ampere and Hopper, no GPU needed."""

import pytest
import torch

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import gemm, triton_aot


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    # A helper jit function and a library one (tl.cdiv, itself a jit function) on purpose: both
    # are interpreter objects under TRITON_INTERPRET=1 and must be swapped for compilation.
    blocks = tl.cdiv(n, BLOCK)
    tl.store(y_ptr + offs, _twice(tl.load(x_ptr + offs, mask=mask)) + blocks * 0, mask=mask)


@pytest.mark.parametrize("capability, tensor_core", [(80, "mma.sync"), (90, "wgmma.mma_async")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemm_compiles_to_tensor_core_ptx(capability, tensor_core, dtype):
    ptx = gemm.ptx(capability, dtype)
    assert f".target sm_{capability}" in ptx
    assert tensor_core in ptx
    summary = triton_aot.ptx_summary(ptx)
    # Pipelined K loop: operands arrive by asynchronous copies (or plain global loads).
    assert summary["async_copies"] + summary["global_loads"] > 0
    assert summary["global_stores"] > 0


def test_bf16_compiles_for_hopper():
    # bf16 cannot be checked under the interpreter, so compiling it is the CPU-side evidence.
    assert "wgmma.mma_async" in gemm.ptx(90, torch.bfloat16)


def _run_scale_kernel():
    x = torch.arange(300, dtype=torch.float32)
    y = torch.empty_like(x)
    _scale_kernel[(2,)](x, y, 300, BLOCK=256)
    torch.testing.assert_close(y, 2 * x)


def test_helpers_and_library_functions_compile_and_interpreter_survives():
    # Running first matters: an interpreter run leaves patched builtins behind in
    # triton.language.core when one jit function calls another, which compilation must undo.
    if device.interpreting():
        _run_scale_kernel()
    ptx = triton_aot.compile_to_ptx(_scale_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"},
                                    {"BLOCK": 256}, capability=80)
    assert ".target sm_80" in ptx and "ld.global" in ptx
    if device.interpreting():
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(tl.cdiv, InterpretedFunction) and isinstance(_twice, InterpretedFunction)
        _run_scale_kernel()


@pytest.mark.interpret
def test_gemm_compiles_after_running_under_the_interpreter():
    a, b = torch.randn(70, 40), torch.randn(40, 50)
    if device.interpreting():
        gemm.check_matmul(gemm.matmul(a, b), a, b)
    assert ".target sm_80" in gemm.ptx(80, torch.float32)
    if device.interpreting():
        gemm.check_matmul(gemm.matmul(a, b), a, b)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="no argument"):
        triton_aot.compile_to_ptx(_scale_kernel, {"z_ptr": "*fp32"}, {"BLOCK": 256})
    with pytest.raises(ValueError, match="'n'"):
        triton_aot.compile_to_ptx(_scale_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32"}, {"BLOCK": 256})
    with pytest.raises(TypeError):
        triton_aot.compile_to_ptx(lambda x: x, {}, {})


def test_a_launch_names_its_own_signature_and_compiles():
    x = torch.arange(300, dtype=torch.float32)
    args, kwargs = (x, torch.empty_like(x), 300), {"BLOCK": 256, "num_warps": 2}
    signature, constexprs = triton_aot.launch_signature(_scale_kernel, args, kwargs)
    assert signature == {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32"} and constexprs == {"BLOCK": 256}
    assert ".target sm_90" in triton_aot.compile_launch(_scale_kernel, args, kwargs)
    with pytest.raises(TypeError, match="no kernel takes"):
        triton_aot.launch_signature(_scale_kernel, (x, x, "300"), {"BLOCK": 256})


@triton.jit
def _python_in_disguise(x_ptr, n, BLOCK: tl.constexpr):
    x_ptr.copy_(torch.zeros(n))


def test_a_body_that_is_python_does_not_compile():
    # Under the interpreter this body would run as Python; Triton's compiler refuses the torch call.
    with pytest.raises(Exception, match="[Uu]nsupported"):  # noqa: B017 - the compiler's error type
        triton_aot.compile_launch(_python_in_disguise, (torch.zeros(4), 4), {"BLOCK": 4})
