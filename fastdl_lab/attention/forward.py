"""The FlashAttention forward kernel (lab 05 attention) and its launch.

One program owns BLOCK_M query rows of one (batch, head) slice and walks the keys BLOCK_N at a
time, keeping the online-softmax state (running maximum, running sum, unnormalised output) in
registers. Scores exist only as a BLOCK_M x BLOCK_N tile: HBM sees q, k, v read and o written,
plus one fp32 logsumexp per row for the backward.

Layout contract shared by every attention kernel: a (batch, heads, N, D) tensor is viewed as
Z = batch * heads slices of N rows of D contiguous elements; ``stride_z`` and ``stride_row`` are
the element distances between slices and between rows, the same for q, k, v, o and their
gradients (the launcher makes them so). Per-row fp32 vectors (logsumexp, delta) are (Z, N)
contiguous.
"""

from __future__ import annotations

import torch

from fastdl_lab import checks
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (i, z): rows i*BLOCK_M ... of slice z; stores o and lse = log(sum_j exp(scale q.k_j))."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_rows = offs_m < N
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], mask=in_rows[:, None], other=0.0)

    # exp(x) = exp2(x log2 e), and exp2 is the GPU's native instruction: scores are scaled into
    # base-2 units once, so that each exponential is a bare exp2.
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    # Causal: keys past this block's last query are masked for every row, so the loop stops there.
    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_keys = offs_n < N
        # k is loaded as a HEAD_DIM x BLOCK_N tile, so that q @ k_t needs no transpose.
        k_t = tl.load(k_ptr + base + offs_n[None, :] * stride_row + offs_d[:, None], mask=in_keys[None, :], other=0.0)
        v = tl.load(v_ptr + base + offs_n[:, None] * stride_row + offs_d[None, :], mask=in_keys[:, None], other=0.0)
        s = tl.dot(q, k_t) * qk_scale
        valid = in_keys[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        # Key 0 lies in the first block of every row (padded rows included), so m_new is finite
        # from the first step on and no exp2 ever sees -inf - (-inf).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        correction = tl.exp2(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        # P goes to the tensor cores in the inputs' precision, accumulating in fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=in_rows[:, None])
    # Back to natural-log units: lse = (m + log2 l) / log2 e.
    tl.store(lse_ptr + z * N + offs_m, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=in_rows)
    ### END SOLUTION


def launch_forward(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` on (Z, N, D) tensors with one layout; returns o (like q) and the fp32 (Z, N) lse."""
    z, n, d = q.shape
    o = checks.output_buffer((z, n, d), q.dtype, q)
    lse = checks.output_buffer((z, n), torch.float32, q)
    if z and n:
        grid = (triton.cdiv(n, config["block_m"]), z)
        kernel[grid](q, k, v, o, lse, q.stride(0), q.stride(1), n, scale,
                     CAUSAL=causal, BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], HEAD_DIM=d,
                     num_warps=config["num_warps"], num_stages=config["num_stages"])
    return o, lse
