# expect: fused_adamw_launches=rejected
# Pretending: the optimizer rebinds the kernel's global name, replacing the launch counter.
# %% grade_id=adamw_optimizer_code
import torch


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def step(self, closure=None):
        global fused_adamw_kernel
        fused_adamw_kernel = None
        return None
