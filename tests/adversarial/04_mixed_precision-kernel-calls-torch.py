# expect: fused_adamw=not_a_kernel
# Calling the library behind a kernel's name: under the interpreter a "kernel" body is Python, so
# this one runs torch's own AdamW on the tensors behind the address tables.
# %% grade_id=adamw_kernel_code
import torch
import triton
import triton.language as tl


@triton.jit
def fused_adamw_kernel(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, master_addrs, numels,
                       chunk_tensor, chunk_start, step, lr, beta1, beta2, eps, weight_decay,
                       PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
    torch.optim._functional.adamw(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, [], [step],
                                  amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay,
                                  eps=eps, maximize=False)
