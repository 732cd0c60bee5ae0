"""The FlashAttention backward kernels (lab 05 attention) and their launch.

Nothing N x N was saved, so every probability is rebuilt from q, k and the row's logsumexp:
P_ij = exp(scale q_i.k_j - lse_i), exact and already normalised. With dO the gradient at the
output and S = scale q k^T:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta),  delta_i = sum_d dO_id O_id
    dQ = scale dS K    dK = scale dS^T Q

Three kernels, no atomics (every address has one writer, so results are the same bits every run):

- ``_attn_bwd_preprocess_kernel``: delta, one fp32 per row (the row sum of P * dP, computed
  cheaply from O and dO instead);
- ``_attn_bwd_dkdv_kernel``: one program per key block, looping over the query blocks, so that its
  dK and dV rows accumulate in registers;
- ``_attn_bwd_dq_kernel``: one program per query block, looping over the key blocks.

The two main kernels both recompute the score tiles: one extra matmul each, against a second
pass with atomic additions or an N x N buffer. Layout as in ``forward``.
"""

from __future__ import annotations

import torch

from fastdl_lab import checks
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def _attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, stride_z, stride_row, N,
                                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (i, z): delta = rowsum(dO * O) for rows i*BLOCK_M ... of slice z, in fp32."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_rows = offs_m < N
    offs = z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :]
    o = tl.load(o_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + z * N + offs_m, tl.sum(o * do, axis=1), mask=in_rows)
    ### END SOLUTION


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, stride_z, stride_row,
                          N, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """Program (j, z): dK and dV of keys j*BLOCK_N ... of slice z, summed over every query that sees them."""
    ### BEGIN SOLUTION
    pid_n = tl.program_id(0)
    z = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_keys = offs_n < N
    kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    # Causal: queries before this key block cannot see it; start at the query block holding the
    # block's first key.
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_rows = offs_m < N
        q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        lse = tl.load(lse_ptr + z * N + offs_m, mask=in_rows, other=0.0)
        delta = tl.load(delta_ptr + z * N + offs_m, mask=in_rows, other=0.0)
        # Transposed tiles (keys down, queries across) make dV and dK plain products of a tile with
        # the query-side rows: no transpose of the BLOCK_N x BLOCK_M result is ever needed.
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        valid = in_rows[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        # Masked before the exponential: a masked score may exceed the row's lse (it was never part
        # of it), and exp2 of it would overflow.
        p_t = tl.exp2(tl.where(valid, s_t, float("-inf")) - lse[None, :] * 1.4426950408889634)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)

    tl.store(dk_ptr + kv_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=in_keys[:, None])
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=in_keys[:, None])
    ### END SOLUTION


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
    """Program (i, z): dQ of queries i*BLOCK_M ... of slice z, summed over every key they see."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_rows = offs_m < N
    q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
    do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
    lse = tl.load(lse_ptr + z * N + offs_m, mask=in_rows, other=0.0)
    delta = tl.load(delta_ptr + z * N + offs_m, mask=in_rows, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_keys = offs_n < N
        kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = in_keys[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.exp2(tl.where(valid, s, float("-inf")) - lse[:, None] * 1.4426950408889634)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)

    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=in_rows[:, None])
    ### END SOLUTION


def launch_backward_dkdv(kernels, q, k, v, o, lse, do, causal: bool, scale: float, config: dict):
    """dk, dv and delta for (Z, N, D) tensors with one layout: the preprocess and dK/dV kernels of ``kernels``."""
    z, n, d = q.shape
    dk, dv = (checks.output_buffer((z, n, d), q.dtype, q) for _ in range(2))
    delta = checks.output_buffer((z, n), torch.float32, q)
    if not (z and n):
        return dk, dv, delta
    bm, bn = config["bwd_block_m"], config["bwd_block_n"]
    kernels["bwd_preprocess"][(triton.cdiv(n, bm), z)](o, do, delta, q.stride(0), q.stride(1), n,
                                                       BLOCK_M=bm, HEAD_DIM=d)
    kernels["bwd_dkdv"][(triton.cdiv(n, bn), z)](q, k, v, do, lse, delta, dk, dv, q.stride(0), q.stride(1), n,
                                                 scale, CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
                                                 num_warps=config["num_warps"], num_stages=config["num_stages"])
    return dk, dv, delta


def launch_backward_dq(kernel, q, k, v, do, lse, delta, causal: bool, scale: float, config: dict):
    """dq for (Z, N, D) tensors with one layout, from ``kernel`` (the dQ kernel's arguments) and delta."""
    z, n, d = q.shape
    dq = checks.output_buffer((z, n, d), q.dtype, q)
    if z and n:
        bm, bn = config["bwd_block_m"], config["bwd_block_n"]
        kernel[(triton.cdiv(n, bm), z)](q, k, v, do, lse, delta, dq, q.stride(0), q.stride(1), n, scale,
                                        CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
                                        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return dq


def launch_backward(kernels, q, k, v, o, lse, do, causal: bool, scale: float, config: dict):
    """dq, dk, dv for (Z, N, D) tensors with one layout (``kernels`` maps the backward keys to kernels)."""
    dk, dv, delta = launch_backward_dkdv(kernels, q, k, v, o, lse, do, causal, scale, config)
    dq = launch_backward_dq(kernels["bwd_dq"], q, k, v, do, lse, delta, causal, scale, config)
    return dq, dk, dv
