# expect: fused_adamw_launches=partial
# Forging the launch count: the optimizer keeps the real kernel in a default argument (bound when
# the class is defined, before the grader puts its counter in the kernel's place), launches it
# once per tensor, and launches the counted name once per step on a one-element dummy, so the
# counter reads one launch per step. The values are AdamW's, which is the point the grader checks
# itself; the launch count is self-reported, and the torch ops the per-tensor tables cost still grow
# with the number of tensors, so the self-reported point is lost anyway.
# %% grade_id=adamw_optimizer_code
import torch
import triton.language as tl
from fastdl_lab.optim import multi_tensor_table


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.dummy = [torch.zeros(1) for _ in range(4)]

    @torch.no_grad()
    def step(self, closure=None, kernel=fused_adamw_kernel):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                table = multi_tensor_table([[p], [p.grad], [state["exp_avg"]], [state["exp_avg_sq"]], [p]], 1024)
                kernel[(table.n_chunks,)](*table.addrs, table.numels, table.chunk_tensor, table.chunk_start,
                                          state["step"], group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], PARAM_DTYPE=tl.float32, HAS_MASTER=False,
                                          BLOCK=1024)
        d = self.dummy
        table = multi_tensor_table([[d[0]], [d[1]], [d[2]], [d[3]], [d[0]]], 1024)
        fused_adamw_kernel[(table.n_chunks,)](*table.addrs, table.numels, table.chunk_tensor, table.chunk_start, 1,
                                              0.0, 0.9, 0.999, 1e-8, 0.0, PARAM_DTYPE=tl.float32,
                                              HAS_MASTER=False, BLOCK=1024)
        return None
