# expect: layernorm_fwd_fp32=not_a_kernel layernorm_bwd=not_a_kernel
# Syntax that reads attributes without naming them, inside a kernel: a match class pattern in the
# @triton.jit body reaches the interpreter's tensors' storage and hands the row to torch, which
# the interpreter would run as Python.
# %% grade_id=layernorm_fwd_code
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                         BLOCK_N: tl.constexpr):
    match x_ptr:
        case object(handle=object(data=x)):
            match y_ptr:
                case object(handle=object(data=y)):
                    y[:] = F.layer_norm(x, x.shape[-1:]).reshape(y.shape)
