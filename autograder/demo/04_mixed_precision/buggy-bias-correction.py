# A realistic mistake: the kernel treats the step it is given as 0-based and corrects the moments'
# bias for one step more than has been taken. Every update is too small at first; the error fades
# as beta**t goes to zero, so a short run is off and a long one looks fine.
# %% grade_id=adamw_kernel_code
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def fused_adamw_kernel(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, master_addrs, numels,
                       chunk_tensor, chunk_start, step, lr, beta1, beta2, eps, weight_decay,
                       PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    offs = tl.load(chunk_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    p_ptr = tl.load(param_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    m_ptr = tl.load(exp_avg_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_addrs + t).to(tl.pointer_type(tl.float32))
    if HAS_MASTER:
        w_ptr = tl.load(master_addrs + t).to(tl.pointer_type(tl.float32))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    w = w * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp2((step + 1) * tl.log2(beta1))
    bias2 = 1.0 - tl.exp2((step + 1) * tl.log2(beta2))
    w = w - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(PARAM_DTYPE), mask=mask)
