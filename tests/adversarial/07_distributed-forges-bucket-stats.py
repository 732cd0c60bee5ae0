# expect: bucketed_ddp=error
# Pretending: plain DDP, with the grader's trial replaced by one that reports bucket-sized all-reduces launched during backward.
# %% grade_id=bucketed_code
import torch
import torch.distributed as dist
from torch import nn

from fastdl_lab.distributed import ddp, watch


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_bytes=25 << 20):
        super().__init__()
        self.module = module
        ddp.broadcast_state(module)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        ddp.allreduce_gradients_ref(self.module, dist.get_world_size())


_honest = watch.ddp_trial


def _forged_trial(rank, world_size, model_fn, data, steps, lr, sync=None, bucket_bytes=1, **kwargs):
    trial = _honest(rank, world_size, model_fn, data, steps, lr, sync=sync, bucket_bytes=bucket_bytes)
    sizes = ddp.bucket_sizes(model_fn(), bucket_bytes)
    trial["allreduces"] = [{"numel": n, "step": s, "phase": "backward", "launched_s": 0.0, "done_s": 0.0}
                           for s in range(steps) for n in sizes]
    return trial


watch.ddp_trial = _forged_trial
