# expect: softmax_fp32=not_a_kernel softmax_fp16=not_a_kernel softmax_speed=not_a_kernel
# Library instead of a kernel: the kernel body imports torch by itself and calls torch.softmax.
# %% grade_id=softmax_kernel_code
import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    y_ptr.copy_(__import__("torch").softmax(x_ptr, dim=-1))
