# expect: ddp_parity=partial
# No overlap, marks forged: every gradient is all-reduced after backward has returned, in finish_gradient_synchronization, while the cell rebinds the marks a rank sends the relay (and the old in-rank all-reduce log) so that the all-reduces look launched during backward. Only the self-reported point rests on those marks.
# %% grade_id=ddp_code
import torch
import torch.distributed as dist
from torch import nn

from autograder.engine import relay_backend
from fastdl_lab.distributed import watch


class DDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for param in self.module.parameters():
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()


def _no_marks(label, group=None):
    return None


relay_backend.mark = _no_marks
watch.AllReduceLog.phase_now = lambda self: "backward"
