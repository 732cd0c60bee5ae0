# expect: fsdp=error
# Hiding memory: keeps every unit's full weights in a buffer set aside when the class is defined, before the grader's first count, and gathers again only for show.
# %% grade_id=fsdp_code
import torch
import torch.distributed as dist
from torch import nn

from fastdl_lab.distributed import fsdp


class GatherParams(torch.autograd.Function):
    """Forward: the unit's full flat vector, gathered from every rank's shard. Backward: its
    gradient, reduce-scattered into this rank's shard and averaged over the ranks."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        unit.gather()
        return unit.full.data

    @staticmethod
    def backward(ctx, grad_full):
        unit = ctx.unit
        shard_grad = torch.empty_like(unit.shard)
        dist.reduce_scatter_single(shard_grad, grad_full.float().contiguous())
        shard_grad /= unit.world_size
        unit.free()
        return shard_grad, None


class FSDPUnit(nn.Module):
    """One unit of a fully sharded model: its parameters are views of this rank's flat shard."""

    # Set aside when the class is defined, before the grader's first count of the rank's memory.
    STASH = [torch.zeros(1 << 12) for _ in range(8)]

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self._fsdp_wrapped_module = module  # torch's FSDP's name: fsdp.clean_name drops it
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = fsdp.flat_layout(module, self.world_size)
        flat = fsdp.flatten_padded(list(module.parameters()), self.shard_size * self.world_size)
        self.start = self.rank * self.shard_size
        self.shard = flat[self.start:self.start + self.shard_size].float().clone().requires_grad_()
        self.compute_dtype = compute_dtype  # None: no mixed precision, inputs left alone
        self.full = torch.empty(self.shard_size * self.world_size, dtype=compute_dtype or torch.float32)
        fsdp.free_storage(self.full)
        fsdp.drop_parameters(self.slots)
        self.params = fsdp.sharded_parameters(self.slots, self.shard, self.start)
        fsdp.register_sharded(self.slots, self.params)  # the layers' own names, views of the shard
        self.shard.register_post_accumulate_grad_hook(
            lambda shard: fsdp.grads_to_parameters(shard, self.slots, self.params, self.start))
        self.next_unit = None  # set by train_fsdp(..., prefetch=True)
        self.stash = FSDPUnit.STASH.pop()
        self._pending = None


    @property
    def module(self):
        return self._fsdp_wrapped_module

    def free(self):
        fsdp.free_storage(self.full)
        fsdp.register_sharded(self.slots, self.params)  # the layers hold their sharded parameters again

    def use_views(self, full):
        fsdp.place_views(self.slots, full)

    def gather(self, async_op=False):
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        fsdp.allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.full.dtype), async_op=async_op)
        if async_op:
            self._pending = work

    def forward(self, x):
        full = GatherParams.apply(self.shard, self)
        kept = self.stash.detach()[:full.numel()]
        kept.copy_(full)  # the full weights now live where no count looks, the gathered copy is freed
        self.use_views(kept)
        out = self.module(fsdp.cast_floating(x, self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out

    def before_backward(self, grad):
        self.gather()  # only for the count: backward runs on the kept weights
        self.free()
