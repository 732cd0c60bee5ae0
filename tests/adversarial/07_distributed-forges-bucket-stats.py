# expect: bucketed_ddp=tampered
# Pretending: plain DDP, with the grader's bucket counters replaced by the numbers a bucketed one would give.
# %% grade_id=bucketed_code
import torch
import torch.distributed as dist

from fastdl_lab.distributed import ddp


class BucketedDDP:
    def __init__(self, model, world_size, bucket_bytes):
        self.model, self.world_size = model, world_size

    def finish_gradient_synchronization(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= self.world_size


def _forged_stats(rank, world_size, model_fn, data, bucket_bytes, sync=None, steps=2):
    n = ddp.expected_num_buckets(model_fn(), bucket_bytes)
    return {"num_buckets": n, "allreduce_calls": 2 * n, "launched_in_backward": n}


ddp.bucket_stats = _forged_stats
