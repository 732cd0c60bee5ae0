# expect: zero1=failed
# Pretending to shard: the whole optimizer on every rank (bit-identical for free), whose state for other ranks' parameters is moved out of sight after every step and put back before the next.
# %% grade_id=zero_code
import torch
import torch.distributed as dist


class Zero1:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = [p for p in params if p.requires_grad]
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.mine = {id(p) for i, p in enumerate(self.params) if i % world_size == rank}
        self.optimizer = optimizer_class(self.params, **defaults)
        self.hidden = {}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def optimizer_state_bytes(self):
        return sum(t.numel() * t.element_size() for p, s in self.optimizer.state.items() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def step(self):
        self.optimizer.state.update(self.hidden)
        self.optimizer.step()
        self.hidden = {p: self.optimizer.state.pop(p) for p in self.params if id(p) not in self.mine}
