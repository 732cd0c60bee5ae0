# expect: fsdp=error fsdp_mixed=error
# One flat parameter per unit: the shard registered as the unit's only parameter (0.shard), the layers' own weights gone, and every input cast to the compute dtype. Trains, but no layer's weight can be found by its name, and token ids become floats.
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
    """One unit of a fully sharded model: its parameters live here as this rank's flat shard."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = fsdp.flat_layout(module, self.world_size)
        flat = fsdp.flatten_padded(list(module.parameters()), self.shard_size * self.world_size)
        start = self.rank * self.shard_size
        self.shard = nn.Parameter(flat[start:start + self.shard_size].float().clone())
        self.compute_dtype = compute_dtype or torch.float32
        self.full = torch.empty(self.shard_size * self.world_size, dtype=self.compute_dtype)
        fsdp.free_storage(self.full)
        fsdp.drop_parameters(self.slots)  # from now on the layers see views of self.full
        self.next_unit = None  # set by train_fsdp(..., prefetch=True)
        self._pending = None

    def free(self):
        fsdp.free_storage(self.full)

    def use_views(self, full):
        fsdp.place_views(self.slots, full)

    def gather(self, async_op=False):
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        fsdp.allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.compute_dtype), async_op=async_op)
        if async_op:
            self._pending = work

    def forward(self, x):
        full = GatherParams.apply(self.shard, self)
        if self.next_unit is not None:
            self.next_unit.gather(async_op=True)
        self.use_views(full)
        out = self.module(x.to(self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out

    def before_backward(self, grad):
        self.gather()
