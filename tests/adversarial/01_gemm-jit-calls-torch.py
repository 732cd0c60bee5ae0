# expect: matmul_fp32=not_a_kernel
# Library instead of a kernel: a @triton.jit function whose body is Python calling torch, which the interpreter would run.
# %% grade_id=matmul_kernel_code
import torch
import triton
import triton.language as tl


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    c_ptr.copy_(torch.matmul(a_ptr, b_ptr))
