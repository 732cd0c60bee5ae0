# A realistic mistake: the kernel sums exp(x) straight away instead of exp(x - max). Ordinary rows
# come out right, but a row of large logits overflows to inf / inf = NaN.
# %% grade_id=softmax_kernel_code
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    total = tl.zeros((), tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + offs < n_cols
        v = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.exp(v), axis=0)
    for start in range(0, n_cols, BLOCK_N):
        mask = start + offs < n_cols
        v = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(y_ptr + row * stride_ym + start + offs, (tl.exp(v) / total).to(y_ptr.dtype.element_ty), mask=mask)
