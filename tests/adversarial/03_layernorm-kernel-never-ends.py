# expect: layernorm_fwd_fp32=timeout
# Stopping the batch: a real kernel that loops for ever; the sandbox's wall-time limit ends it.
# %% grade_id=layernorm_fwd_code
import triton
import triton.language as tl


@triton.jit
def layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                         BLOCK_N: tl.constexpr):
    acc = 0.0
    for i in range(0, 1 << 40):
        acc += 1.0
    tl.store(y_ptr, acc)
