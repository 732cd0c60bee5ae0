"""W8A8: int8 activations times int8 weights, int32 accumulation, fp32 out (lab 09 custom ops).

``out[m, n] = (sum_k a_q[m, k] * w_q[n, k]) * a_scale[m] * w_scale[n]``: activations quantised
per row (per token, at run time), weights per output channel (once, offline). The scales factor
out of the sum, so the whole inner loop is integer arithmetic, which is what int8 tensor cores do
(``mma.sync ... .s8.s8.s32`` on Ampere, ``wgmma ... .s32.s8.s8`` on Hopper): twice the fp16
rate, with half the bytes per operand.

- ``int8_matmul_ref``: the specification, exact: the integer sum in float64 (every partial sum is
  an integer far below 2^53), then the epilogue in fp32 in the kernel's order;
- ``_int8_matmul_kernel`` + ``int8_matmul``: the Triton kernel, ``tl.dot`` on int8 tiles with an
  int32 accumulator, dequantised in the epilogue; the Triton interpreter runs the same source on
  a CPU, where ``tl.dot`` on int8 is NumPy's integer matmul and so exact too;
- ``compiled``/``ptx``: the kernel compiled for sm_80 / sm_90 without a GPU, at the launch's
  configuration (``default_config``), to show the integer MMA it uses;
- ``W8A8Linear``: an ``nn.Linear`` replaced by int8 weights and dynamic int8 activations;
  ``quantize_linears`` swaps every Linear of a model for one.

The result is defined bit for bit: an int32 sum is exact whatever order the tiles add in, the
conversion to fp32 rounds to nearest even everywhere, and both products are taken left to right.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU
from fastdl_lab.quant.formats import quantize, quantize_activation

import triton
import triton.language as tl

# The int32 accumulator holds K products of at most 128 * 128 (-128 is a legal int8 input even if
# the course's quantisers never produce it): past this depth a sum could overflow, and overflow is
# not even consistent: NumPy (the interpreter) wraps, while Ampere's integer MMA saturates
# (``.satfinite`` in the PTX).
MAX_K = (2**31 - 1) // (128 * 128)


def _check_ref_operands(a_q, a_scale, w_q, w_scale) -> None:
    for name, t, dtype, dim in (("a_q", a_q, torch.int8, 2), ("w_q", w_q, torch.int8, 2),
                                ("a_scale", a_scale, torch.float32, 1), ("w_scale", w_scale, torch.float32, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")
    (m, k), (n, k2) = a_q.shape, w_q.shape
    if k != k2:
        raise ValueError(f"a_q is {m}x{k} but w_q is {n}x{k2}: w_q holds one row of K codes per output")
    if a_scale.shape[0] != m or w_scale.shape[0] != n:
        raise ValueError(f"need one a_scale per row of a_q ({m}) and one w_scale per row of w_q ({n}); "
                         f"got {a_scale.shape[0]} and {w_scale.shape[0]}")
    if k > MAX_K:
        raise ValueError(f"K={k} could overflow the int32 accumulator (at most {MAX_K})")


def int8_matmul_ref(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                    w_scale: torch.Tensor) -> torch.Tensor:
    """``(a_q @ w_q.T)`` as int32, then ``acc.float() * a_scale[:, None] * w_scale[None, :]``, fp32.

    ``a_q`` is M x K, ``w_q`` is N x K (``nn.Linear``'s weight layout), scales fp32 of M and N.
    """
    _check_ref_operands(a_q, a_scale, w_q, w_scale)
    # float64 rather than an integer matmul: CUDA has none for int64, and |sum| < 2^31 keeps every
    # partial sum exact in float64 whatever order the BLAS adds in.
    acc = (a_q.double() @ w_q.double().T).to(torch.int32)
    return acc.float() * a_scale[:, None] * w_scale[None, :]


@triton.jit
def _int8_matmul_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_wn, stride_wk,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (pid_m, pid_n) computes one BLOCK_M x BLOCK_N tile of C = dequant(A_q @ W_q^T)."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_m = offs_m < M
    in_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    # W is N x K; its tile is read as K x N, i.e. W^T, so that tl.dot gets (M, K) @ (K, N).
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        # Codes past the edge load as 0 and add nothing to the integer sum.
        a = tl.load(a_ptrs, mask=in_m[:, None] & (offs_k[None, :] < k_left), other=0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & in_n[None, :], other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    # Dequantise once per output instead of once per product: the scales factor out of the sum.
    a_scale = tl.load(a_scale_ptr + offs_m, mask=in_m, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=in_n, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out, mask=in_m[:, None] & in_n[None, :])
    ### END SOLUTION


# Triton's argument types for ahead-of-time compilation (see ``ptx``).
SIGNATURE = {
    "a_ptr": "*i8", "w_ptr": "*i8", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "c_ptr": "*fp32",
    "M": "i32", "N": "i32", "K": "i32",
    "stride_am": "i32", "stride_ak": "i32", "stride_wn": "i32", "stride_wk": "i32",
    "stride_cm": "i32", "stride_cn": "i32",
}


def default_config(capability: int | None) -> dict[str, int]:
    """Tiles, warps and stages of a launch on a GPU of ``capability`` (None: the CPU interpreter)."""
    if capability is None:
        # The interpreter's cost follows the number of programs: large tiles keep CPU runs short.
        return {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 1}
    # An int8 MMA step is 32 deep; 128-byte K-slices of 128-row tiles make full cache lines, and
    # three stages of them take 96 KiB of shared memory, within every course GPU's budget. Eight
    # warps share the 128 x 128 int32 accumulator: with four, each thread needs all 255 registers
    # and sm_80 spills (benchmarks/results/kernels_sm80.csv lists it now at 136).
    return {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}


def _check_kernel_operands(a_q, a_scale, w_q, w_scale) -> None:
    _check_ref_operands(a_q, a_scale, w_q, w_scale)
    devices = {t.device for t in (a_q, a_scale, w_q, w_scale)}
    if len(devices) > 1:
        raise ValueError(f"operands are on several devices: {sorted(map(str, devices))}")
    for name, t in (("a_q", a_q), ("a_scale", a_scale), ("w_q", w_q), ("w_scale", w_scale)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (row-major, K innermost): call .contiguous() first")
    # The course-wide gate for interpreter and device (the scales are the float operands).
    device.check_kernel_tensor(a_scale, "the operands are")


def int8_matmul(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, *,
                kernel=None, block_m: int | None = None, block_n: int | None = None,
                block_k: int | None = None) -> torch.Tensor:
    """``int8_matmul_ref`` with a Triton kernel (``kernel`` defaults to ``_int8_matmul_kernel``).

    ``kernel`` must take ``_int8_matmul_kernel``'s arguments and is launched on a 2-D grid:
    axis 0 over tiles of M, axis 1 over tiles of N. The result is an fp32 M x N tensor that must
    equal the reference exactly.
    """
    _check_kernel_operands(a_q, a_scale, w_q, w_scale)
    config = default_config(device.capability(a_q))
    for key, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value is not None:
            config[key] = value
    for key, least in (("block_m", 16), ("block_n", 16), ("block_k", 32)):
        size = config[key]
        # Integer MMA instructions are 32 deep along K; tl.dot needs powers of two.
        if size < least or size & (size - 1):
            raise ValueError(f"{key} must be a power of two >= {least}, got {size}")

    (M, K), N = a_q.shape, w_q.shape[0]
    c = checks.output_buffer((M, N), torch.float32, a_q)
    if M == 0 or N == 0:
        return c
    bm, bn = config["block_m"], config["block_n"]
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    (kernel or _int8_matmul_kernel)[grid](
        a_q, w_q, a_scale, w_scale, c, M, N, K,
        a_q.stride(0), a_q.stride(1), w_q.stride(0), w_q.stride(1), c.stride(0), c.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config["block_k"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return c


def check_int8_matmul(actual, a_q, a_scale, w_q, w_scale, name: str = "int8_matmul") -> None:
    """Raise ``checks.MismatchError`` unless ``actual`` equals the reference bit for bit."""
    expected = int8_matmul_ref(a_q.cpu(), a_scale.cpu(), w_q.cpu(), w_scale.cpu())
    if isinstance(actual, torch.Tensor):
        actual = actual.cpu()
    checks.assert_close(actual, expected, atol=0.0, rtol=0.0, name=name)


def compiled(capability: int = 90, *, kernel=None, **overrides):
    """Triton's compiled int8 kernel for an NVIDIA GPU of ``capability`` (80 = A100, 90 = H100), no GPU
    needed, at ``default_config(capability)`` with ``overrides`` (tiles, warps, stages) on top: by
    default what ``int8_matmul`` launches there.

    Compiled as a launch on contiguous operands with sizes that are multiples of 16 would be.
    """
    from fastdl_lab import triton_aot

    config = default_config(capability)
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the options are {sorted(config)}")
    config.update(overrides)
    constexprs = {"BLOCK_M": config["block_m"], "BLOCK_N": config["block_n"], "BLOCK_K": config["block_k"],
                  "stride_ak": 1, "stride_wk": 1, "stride_cn": 1}
    aligned = ["a_ptr", "w_ptr", "a_scale_ptr", "w_scale_ptr", "c_ptr", "M", "N", "K",
               "stride_am", "stride_wn", "stride_cm"]
    return triton_aot.compile_kernel(kernel or _int8_matmul_kernel, SIGNATURE, constexprs, capability=capability,
                                     num_warps=config["num_warps"], num_stages=config["num_stages"],
                                     divisible_by_16=aligned)


def ptx(capability: int = 90, *, kernel=None, **overrides) -> str:
    """PTX of ``compiled(...)``."""
    return compiled(capability, kernel=kernel, **overrides).asm["ptx"]


class W8A8Linear(nn.Module):
    """An ``nn.Linear`` run as W8A8: int8 weights with a scale per output channel, computed once;
    int8 activations with a scale per row, computed on every call; the product by ``int8_matmul``.

    ``kernel`` is passed to ``int8_matmul`` (None: the package's kernel). The bias stays fp32 and
    is added after the epilogue.
    """

    def __init__(self, linear: nn.Linear, *, kernel=None):
        super().__init__()
        q, scale, _ = quantize(linear.weight, axis=0)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("w_q", q.contiguous())
        self.register_buffer("w_scale", scale.contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        a_q, a_scale = quantize_activation(rows)
        out = int8_matmul(a_q.contiguous(), a_scale.contiguous(), self.w_q, self.w_scale, kernel=self.kernel)
        if self.bias is not None:
            out = out + self.bias
        # The epilogue is fp32; the layer hands back the dtype it was given, as the Linear did.
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights per channel"


def quantize_linears(model: nn.Module, *, kernel=None) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` replaced by a ``W8A8Linear`` (post-training
    int8 quantisation of weights and activations, through the Triton kernel)."""
    quantized = copy.deepcopy(model).eval()
    for parent in quantized.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                setattr(parent, name, W8A8Linear(child, kernel=kernel))
    return quantized
