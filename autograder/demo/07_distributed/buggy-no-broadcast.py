# A realistic mistake: the bucketed wrapper averages gradients correctly but never broadcasts rank
# 0's parameters and buffers, so ranks that were initialised differently train replicas that
# never agree (and a buffer that differs per rank changes every rank's gradients too).
# %% grade_id=bucketed_code
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_bytes=25 << 20):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets, bucket, filled = [], [], 0
        for p in params[::-1]:
            bucket.append(p)
            filled += p.numel() * p.element_size()
            if filled >= bucket_bytes:
                self.buckets.append(bucket)
                bucket, filled = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.where = {p: i for i, members in enumerate(self.buckets) for p in members}
        self.arrived, self.next_bucket, self.pending = [0] * len(self.buckets), 0, []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, x):
        return self.module(x)

    @property
    def num_buckets(self):
        return len(self.buckets)

    def _grad_ready(self, param):
        self.arrived[self.where[param]] += 1
        while self.next_bucket < len(self.buckets) and self.arrived[self.next_bucket] == len(self.buckets[self.next_bucket]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[self.next_bucket]])
            self.pending.append((self.next_bucket, flat, dist.all_reduce(flat, async_op=True)))
            self.next_bucket += 1

    def finish_gradient_synchronization(self):
        for index, flat, handle in self.pending:
            handle.wait()
            flat /= self.world_size
            start = 0
            for p in self.buckets[index]:
                p.grad.copy_(flat[start:start + p.numel()].view_as(p))
                start += p.numel()
        self.arrived, self.next_bucket, self.pending = [0] * len(self.buckets), 0, []
