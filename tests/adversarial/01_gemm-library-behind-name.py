# expect: matmul_fp32=not_a_kernel matmul_fp16=not_a_kernel
# Library instead of a kernel: a plain function under the kernel's name, and the launcher patched to torch.matmul.
# %% grade_id=matmul_kernel_code
import torch

from fastdl_lab import gemm


def matmul_kernel(*args, **kwargs):
    raise RuntimeError("never launched")


gemm.matmul = lambda a, b, **kw: torch.matmul(a, b)
