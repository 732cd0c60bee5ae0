# A realistic mistake: the gradients are summed over the ranks but never divided by the world
# size, so every step is world_size times too large.
# %% grade_id=ddp_code
import torch
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.handles = []
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, x):
        return self.module(x)

    def _grad_ready(self, param):
        self.handles.append(dist.all_reduce(param.grad, async_op=True))

    def finish_gradient_synchronization(self):
        for handle in self.handles:
            handle.wait()
        self.handles = []
