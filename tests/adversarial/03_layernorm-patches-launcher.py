# expect: layernorm_fwd_fp32=failed layernorm_fwd_fp16=failed
# Library instead of a kernel: an empty kernel, and the launcher replaced by F.layer_norm in the same cell.
# %% grade_id=layernorm_fwd_code
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdl_lab import layernorm


@triton.jit
def layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                         BLOCK_N: tl.constexpr):
    pass


layernorm.layer_norm = lambda x, w, b, eps=1e-5, **kw: F.layer_norm(x, x.shape[-1:], w, b, eps)
