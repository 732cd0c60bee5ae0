# A realistic mistake: when a later key block raises the running max, the running sum is not
# rescaled (the accumulator is). Rows whose keys fit in one block are still right.
# %% grade_id=attn_fwd_code
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_rows = offs_m < N
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], mask=in_rows[:, None], other=0.0)

    qk_scale = scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_keys = offs_n < N
        k_t = tl.load(k_ptr + base + offs_n[None, :] * stride_row + offs_d[:, None], mask=in_keys[None, :], other=0.0)
        v = tl.load(v_ptr + base + offs_n[:, None] * stride_row + offs_d[None, :], mask=in_keys[:, None], other=0.0)
        s = tl.dot(q, k_t) * qk_scale
        valid = in_keys[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        correction = tl.exp2(m_i - m_new)
        l_i = l_i + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=in_rows[:, None])
    tl.store(lse_ptr + z * N + offs_m, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=in_rows)
