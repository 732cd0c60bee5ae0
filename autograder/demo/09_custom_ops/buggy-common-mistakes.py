# Three realistic mistakes in one submission (the C++ cell is the reference's, so one build grades all
# three):
# - per_channel_int8: one scale for the whole tensor, copied to every channel. The codes fit the largest
#   weight anywhere, and channels whose weights are all small get only a few of the 255 levels;
# - int8_matmul: the partial sums are kept in 16 bits to save registers. One product of two int8 codes
#   already needs 15 bits; a few dozen of them wrap around;
# - qat_beats_ptq: fake quantisation with torch.round and no straight-through estimator. Rounding has a
#   zero gradient almost everywhere, so QAT changes nothing and the model stays as PTQ left it.
# %% grade_id=quant_code
def quantize_per_channel(w):
    rows = w.detach().float().reshape(w.shape[0], -1)
    top = rows.abs().max()
    scale = (top / 127 if top > 0 else torch.tensor(1.0)).expand(w.shape[0]).contiguous()
    codes = torch.round(rows / scale[:, None]).clamp(-127, 127)
    return codes.to(torch.int8).reshape(w.shape), scale


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
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int16)
    for start in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=(rows[:, None] < M) & (ks[None, :] + start < K), other=0)
        w = tl.load(w_tile, mask=(ks[:, None] + start < K) & (cols[None, :] < N), other=0)
        total += tl.dot(a, w, out_dtype=tl.int32).to(tl.int16)
        a_tile += BLOCK_K * stride_ak
        w_tile += BLOCK_K * stride_wk
    sa = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    result = total.to(tl.float32) * sa[:, None] * sw[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, result,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


# %% grade_id=qat_code
def fake_quant(x, scale, zero_point=0, bits=8):
    top = 2 ** (bits - 1) - 1
    return (torch.round(x / scale + zero_point).clamp(-top, top) - zero_point) * scale
