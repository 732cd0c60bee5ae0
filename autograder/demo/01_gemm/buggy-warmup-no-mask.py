# A realistic mistake: the warm-up masks the rows but not the columns, as if N were always a
# multiple of BLOCK_N. The last step of every row reads past its end: into the padding or the
# next row, and past the tensor for the last row, which the checked interpreter stops.
# %% grade_id=row_sum_kernel_code
import triton
import triton.language as tl


@triton.jit
def row_sum_kernel(
    x_ptr, y_ptr,
    M, N,
    stride_xm, stride_xn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        ptrs = x_ptr + rows[:, None] * stride_xm + (start + cols)[None, :] * stride_xn
        acc += tl.sum(tl.load(ptrs, mask=rows[:, None] < M, other=0.0).to(tl.float32), axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < M)
