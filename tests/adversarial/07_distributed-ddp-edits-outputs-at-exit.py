# expect: ddp_parity=tampered
# Rewriting the evidence after the grader saved it: all-reduces launched after backward (no overlap),
# and an exit hook that relabels every one as launched during backward in the saved outputs.
# %% grade_id=ddp_code
import atexit
import os

import torch
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= self.world_size


def _relabel_saved_outputs():
    if not os.path.exists("outputs.pt"):
        return
    worlds = torch.load("outputs.pt", weights_only=True)
    for world in worlds:
        for rank in world:
            for call in rank["allreduces"]:
                call["phase"] = "backward"
    torch.save(worlds, "outputs.pt")


atexit.register(_relabel_saved_outputs)
