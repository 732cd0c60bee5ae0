# expect: int8_matmul=partial
# Pretending to be an integer kernel: the codes are converted to float32 and multiplied on the float
# path. Small sums are exact, so short tests pass; past 2^24 a float32 sum rounds, and deep
# products are no longer the integer result.
# %% grade_id=kernel_code
from fastdl_lab import device  # noqa: F401

import triton
import triton.language as tl


@triton.jit
def int8_matmul_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, c_ptr, M, N, K,
                       stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    w_tile = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=(rows[:, None] < M) & (ks[None, :] + start < K), other=0).to(tl.float32)
        w = tl.load(w_tile, mask=(ks[:, None] + start < K) & (cols[None, :] < N), other=0).to(tl.float32)
        total = tl.dot(a, w, total, input_precision="ieee")
        a_tile += BLOCK_K * stride_ak
        w_tile += BLOCK_K * stride_wk
    sa = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    result = total * sa[:, None] * sw[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, result,
             mask=(rows[:, None] < M) & (cols[None, :] < N))
