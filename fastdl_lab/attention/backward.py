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
pass with atomic additions or an N x N buffer. Layout, and the split of each loop into unmasked
off-diagonal blocks and masked diagonal ones, as in ``forward``.
"""

from __future__ import annotations

import torch

from fastdl_lab import checks
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)
from fastdl_lab.attention.forward import declared, even_n

import triton
import triton.language as tl


@triton.jit
def _attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, stride_z, stride_row, N,
                                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr = False):
    """Program (i, z): delta = rowsum(dO * O) for rows i*BLOCK_M ... of slice z, in fp32."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs = z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :]
    if EVEN_N:
        o = tl.load(o_ptr + offs).to(tl.float32)
        do = tl.load(do_ptr + offs).to(tl.float32)
        tl.store(delta_ptr + z * N + offs_m, tl.sum(o * do, axis=1))
    else:
        in_rows = offs_m < N
        o = tl.load(o_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
        do = tl.load(do_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
        tl.store(delta_ptr + z * N + offs_m, tl.sum(o * do, axis=1), mask=in_rows)
    ### END SOLUTION


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, base, row0, stride_row, offs_n, offs_d, N,
                qk_scale, lo, hi, CAUSAL_MASK: tl.constexpr, ROW_MASK: tl.constexpr, BLOCK_M: tl.constexpr):
    """dK/dV accumulation over the query blocks lo, lo + BLOCK_M, ... < hi; returns (dk, dv).

    ``row0`` is the slice's offset into the per-row vectors. Masks are compile-time choices, as in
    the forward's steps.
    """
    ### BEGIN SOLUTION
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
        if ROW_MASK:
            # Rows past N load as zeros (q, dO, lse and delta), which makes their share of dV and dK
            # exactly 0 (dO = 0, and dS = P (dP - delta) = 1 * (0 - 0)): no score mask is needed.
            in_rows = offs_m < N
            q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
            do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
            lse2 = tl.load(lse_ptr + row0 + offs_m, mask=in_rows, other=0.0) * 1.4426950408889634
            delta = tl.load(delta_ptr + row0 + offs_m, mask=in_rows, other=0.0)
        else:
            q = tl.load(q_ptr + q_offs)
            do = tl.load(do_ptr + q_offs)
            lse2 = tl.load(lse_ptr + row0 + offs_m) * 1.4426950408889634
            delta = tl.load(delta_ptr + row0 + offs_m)
        # Transposed tiles (keys down, queries across) make dV and dK plain products of a tile with
        # the query-side rows: no transpose of the BLOCK_N x BLOCK_M result is ever needed.
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if CAUSAL_MASK:
            # Masked before the exponential: a masked score may exceed the row's lse (it was never
            # part of it), and exp2 of it would overflow.
            s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse2[None, :])
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv
    ### END SOLUTION


@triton.jit
def _attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, stride_z, stride_row,
                          N, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr = False):
    """Program (j, z): dK and dV of keys j*BLOCK_N ... of slice z, summed over every query that sees them.

    ``EVEN_N`` as in the forward: N is a multiple of both tiles, so nothing needs a bounds mask.
    """
    ### BEGIN SOLUTION
    pid_n = tl.program_id(0)
    z = tl.program_id(1)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
    if EVEN_N:
        k = tl.load(k_ptr + kv_offs)
        v = tl.load(v_ptr + kv_offs)
    else:
        in_keys = offs_n < N
        k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    if CAUSAL:
        # Queries before the query block holding this block's first key see none of it. The blocks
        # from there up to the first one that starts past the last key straddle the diagonal and
        # compare query with key; every later block sees all of these keys and compares nothing.
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = ((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        if EVEN_N:
            diag_hi = mid
        else:
            diag_hi = tl.minimum(mid, N)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, base, z * N, stride_row, offs_n,
                             offs_d, N, qk_scale, lo, diag_hi, True, not EVEN_N, BLOCK_M)
        dk, dv = _dkdv_steps(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, base, z * N, stride_row, offs_n,
                             offs_d, N, qk_scale, mid, N, False, not EVEN_N, BLOCK_M)
    else:
        dk, dv = _dkdv_steps(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, base, z * N, stride_row, offs_n,
                             offs_d, N, qk_scale, 0, N, False, not EVEN_N, BLOCK_M)

    dk = (dk * scale).to(dk_ptr.dtype.element_ty)
    dv = dv.to(dv_ptr.dtype.element_ty)
    if EVEN_N:
        tl.store(dk_ptr + kv_offs, dk)
        tl.store(dv_ptr + kv_offs, dv)
    else:
        tl.store(dk_ptr + kv_offs, dk, mask=in_keys[:, None])
        tl.store(dv_ptr + kv_offs, dv, mask=in_keys[:, None])
    ### END SOLUTION


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale, lo, hi,
              CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ accumulation over the key blocks lo, lo + BLOCK_N, ... < hi; returns dq."""
    ### BEGIN SOLUTION
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
        if KEY_MASK:
            in_keys = offs_n < N
            k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_offs)
            v = tl.load(v_ptr + kv_offs)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        # A key past N scores 0, and exp2(0 - lse) may overflow: it is masked, unlike the dK/dV
        # kernel's padded queries, whose zeros cancel.
        if CAUSAL_MASK:
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        elif KEY_MASK:
            s = tl.where(offs_n[None, :] < N, s, float("-inf"))
        p = tl.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq
    ### END SOLUTION


@triton.jit
def _attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, EVEN_N: tl.constexpr = False):
    """Program (i, z): dQ of queries i*BLOCK_M ... of slice z, summed over every key they see."""
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
    if EVEN_N:
        q = tl.load(q_ptr + q_offs)
        do = tl.load(do_ptr + q_offs)
        lse = tl.load(lse_ptr + z * N + offs_m)
        delta = tl.load(delta_ptr + z * N + offs_m)
    else:
        in_rows = offs_m < N
        q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        lse = tl.load(lse_ptr + z * N + offs_m, mask=in_rows, other=0.0)
        delta = tl.load(delta_ptr + z * N + offs_m, mask=in_rows, other=0.0)
    lse2 = lse * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    if CAUSAL:
        # As in the forward: unmasked blocks before the diagonal, then the diagonal block(s).
        diag = (start_m // BLOCK_N) * BLOCK_N
        dq = _dq_steps(dq, q, do, lse2, delta, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                       0, diag, False, False, BLOCK_N)
        if EVEN_N:
            hi = start_m + BLOCK_M
        else:
            hi = tl.minimum(N, start_m + BLOCK_M)
        dq = _dq_steps(dq, q, do, lse2, delta, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                       diag, hi, True, not EVEN_N, BLOCK_N)
    else:
        if EVEN_N:
            full = N
        else:
            full = (N // BLOCK_N) * BLOCK_N
        dq = _dq_steps(dq, q, do, lse2, delta, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                       0, full, False, False, BLOCK_N)
        if not EVEN_N:
            dq = _dq_steps(dq, q, do, lse2, delta, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                           full, N, False, True, BLOCK_N)

    dq = (dq * scale).to(dq_ptr.dtype.element_ty)
    if EVEN_N:
        tl.store(dq_ptr + q_offs, dq)
    else:
        tl.store(dq_ptr + q_offs, dq, mask=in_rows[:, None])
    ### END SOLUTION


def launch_backward_dkdv(kernels, q, k, v, o, lse, do, causal: bool, scale: float, config: dict):
    """dk, dv and delta for (Z, N, D) tensors with one layout: the preprocess and dK/dV kernels of ``kernels``."""
    z, n, d = q.shape
    dk, dv = (checks.output_buffer((z, n, d), q.dtype, q) for _ in range(2))
    delta = checks.output_buffer((z, n), torch.float32, q)
    if not (z and n):
        return dk, dv, delta
    bm, bn = config["bwd_block_m"], config["bwd_block_n"]
    even = even_n(n, bm, bn)
    pre, dkdv = kernels["bwd_preprocess"], kernels["bwd_dkdv"]
    pre[(triton.cdiv(n, bm), z)](o, do, delta, q.stride(0), q.stride(1), n,
                                 BLOCK_M=bm, HEAD_DIM=d, **declared(pre, EVEN_N=even),
                                 num_warps=config["bwd_num_warps"], num_stages=config["bwd_num_stages"])
    dkdv[(triton.cdiv(n, bn), z)](q, k, v, do, lse, delta, dk, dv, q.stride(0), q.stride(1), n, scale,
                                  CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, **declared(dkdv, EVEN_N=even),
                                  num_warps=config["bwd_num_warps"], num_stages=config["bwd_num_stages"])
    return dk, dv, delta


def launch_backward_dq(kernel, q, k, v, do, lse, delta, causal: bool, scale: float, config: dict):
    """dq for (Z, N, D) tensors with one layout, from ``kernel`` (the dQ kernel's arguments) and delta."""
    z, n, d = q.shape
    dq = checks.output_buffer((z, n, d), q.dtype, q)
    if z and n:
        bm, bn = config["bwd_block_m"], config["bwd_block_n"]
        kernel[(triton.cdiv(n, bm), z)](q, k, v, do, lse, delta, dq, q.stride(0), q.stride(1), n, scale,
                                        CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d,
                                        **declared(kernel, EVEN_N=even_n(n, bm, bn)),
                                        num_warps=config["bwd_num_warps"], num_stages=config["bwd_num_stages"])
    return dq


def launch_backward(kernels, q, k, v, o, lse, do, causal: bool, scale: float, config: dict):
    """dq, dk, dv for (Z, N, D) tensors with one layout (``kernels`` maps the backward keys to kernels)."""
    dk, dv, delta = launch_backward_dkdv(kernels, q, k, v, o, lse, do, causal, scale, config)
    dq = launch_backward_dq(kernels["bwd_dq"], q, k, v, do, lse, delta, causal, scale, config)
    return dq, dk, dv
