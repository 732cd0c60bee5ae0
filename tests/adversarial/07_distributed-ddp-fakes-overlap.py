# expect: ddp_parity=partial
# Pretending to overlap: every all-reduce waits until backward is over, then runs inside a throwaway backward of its own, so that autograd looks busy.
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

    def forward(self, x):
        return self.module(x)

    def _average_all(self, grad):
        for param in self.module.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()

    def finish_gradient_synchronization(self):
        decoy = torch.ones(1, requires_grad=True)
        loss = (decoy * 2).sum()
        loss.register_hook(self._average_all)
        loss.backward()
