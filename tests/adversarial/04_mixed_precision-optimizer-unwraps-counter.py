# expect: fused_adamw_launches=rejected
# Pretending: the optimizer launches once per tensor, through the kernel object the launch counter
# wraps, so that the counter never sees the launches.
# %% grade_id=adamw_optimizer_code
import torch
import triton.language as tl
from fastdl_lab.optim import multi_tensor_table


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        kernel = fused_adamw_kernel._kernel
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                table = multi_tensor_table([[p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [p]], 1024)
                kernel[(table.n_chunks,)](*table.addrs, table.numels, table.chunk_tensor, table.chunk_start,
                                          state["step"], group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], PARAM_DTYPE=tl.float32, HAS_MASTER=False,
                                          BLOCK=1024)
        return None
