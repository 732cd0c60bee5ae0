# A realistic mistake: the forward kernel takes the variance as E[x^2] - E[x]^2 in one pass.
# Well-scaled rows pass; rows whose mean is large next to their spread lose every digit.
# %% grade_id=layernorm_fwd_code
import triton
import triton.language as tl


@triton.jit
def layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                         BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    s1 = tl.zeros((), tl.float32)
    s2 = tl.zeros((), tl.float32)
    for start in range(0, N, BLOCK_N):
        mask = start + offs < N
        v = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        s1 += tl.sum(v, axis=0)
        s2 += tl.sum(v * v, axis=0)
    mean = s1 / N
    var = s2 / N - mean * mean
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    for start in range(0, N, BLOCK_N):
        mask = start + offs < N
        v = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        out = (v - mean) * rstd * w + b
        tl.store(y_ptr + row * stride_ym + start + offs, out.to(y_ptr.dtype.element_ty), mask=mask)
