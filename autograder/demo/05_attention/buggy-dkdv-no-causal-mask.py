# A realistic mistake: the dK/dV kernel masks the rows past N but forgets the causal mask, so a key
# collects gradient from earlier queries that never saw it. Full attention is still right.
# %% grade_id=attn_bwd_code
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, stride_z, stride_row, N,
                               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_rows = offs_m < N
    offs = z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :]
    o = tl.load(o_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + z * N + offs_m, tl.sum(o * do, axis=1), mask=in_rows)


@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, stride_z, stride_row,
                         N, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
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
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        valid = in_rows[None, :]
        p_t = tl.exp2(tl.where(valid, s_t, float("-inf")) - lse[None, :] * 1.4426950408889634)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)

    tl.store(dk_ptr + kv_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=in_keys[:, None])
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=in_keys[:, None])
