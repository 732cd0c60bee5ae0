# expect: matmul_fp32=not_a_kernel
# Code at definition time: an annotation is evaluated when the function is defined.
# %% grade_id=matmul_kernel_code
import triton
import triton.language as tl


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: (__import__("os").system("touch /tmp/fastdl-adversarial-pwned") or tl.constexpr),
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pass
