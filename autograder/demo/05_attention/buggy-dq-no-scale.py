# A realistic mistake: the optional dQ kernel forgets the final factor tau = 1/sqrt(d) (dQ = tau dS K).
# %% grade_id=attn_bwd_dq_code
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr):
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

    tl.store(dq_ptr + q_offs, dq.to(dq_ptr.dtype.element_ty), mask=in_rows[:, None])
