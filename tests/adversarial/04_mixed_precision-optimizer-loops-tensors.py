# expect: fused_adamw_launches=partial
# Pretending to be fused: AdamW done tensor by tensor with torch ops, and one launch of the kernel
# on a single tensor so that the launch counter reads one per step.
# %% grade_id=adamw_optimizer_code
import math

import torch
import triton.language as tl
from fastdl_lab.optim import multi_tensor_table


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                if p is params[0]:
                    table = multi_tensor_table([[p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [p]], 1024)
                    fused_adamw_kernel[(table.n_chunks,)](
                        *table.addrs, table.numels, table.chunk_tensor, table.chunk_start, t, group["lr"], beta1,
                        beta2, group["eps"], group["weight_decay"], PARAM_DTYPE=tl.float32, HAS_MASTER=False,
                        BLOCK=1024)
                    continue
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** t))
        return None
