# A realistic mistake: each rank steps the parameters it owns with the real optimizer but never
# broadcasts them, so every rank keeps the other ranks' parameters as they were at the start.
# %% grade_id=zero_code
import torch
import torch.distributed as dist


class Zero1:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = [p for p in params if p.requires_grad]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        owned = [0] * world_size
        self.owners = [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            self.owners[i] = min(range(world_size), key=lambda r: owned[r])
            owned[self.owners[i]] += self.params[i].numel()
        mine = [p for p, owner in zip(self.params, self.owners) if owner == rank]
        self.optimizer = optimizer_class(mine, **defaults)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
