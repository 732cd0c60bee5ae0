# expect: zero1=failed
# Pretending to shard: every rank keeps optimizer state for every parameter (bit-identical for free), broadcasts from the owners as ZeRO does, and steps the parameters it does not own through aliases of their storage, so that the state watched inside the rank is the owned parameters' only.
# %% grade_id=zero_code
import torch
import torch.distributed as dist


class Zero1:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = dist.get_world_size()
        load = [0] * self.world_size
        self.owners = [0] * len(self.params)
        order = sorted(range(len(self.params)), key=lambda i: (-self.params[i].numel(), i))
        for i in order:
            rank = min(range(self.world_size), key=lambda r: (load[r], r))
            self.owners[i] = rank
            load[rank] += self.params[i].numel()
        rank = dist.get_rank()
        mine = [p for p, owner in zip(self.params, self.owners) if owner == rank]
        others = [p for p, owner in zip(self.params, self.owners) if owner != rank]
        # The same storage under another name: its state is keyed by the alias.
        self.aliases = [(p, p.detach()) for p in others]
        self.optimizer = optimizer_class(mine, **defaults) if mine else None
        self.shadow = optimizer_class([alias for _, alias in self.aliases], **defaults) if others else None

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        if self.optimizer is not None:
            self.optimizer.step()
        if self.shadow is not None:
            for p, alias in self.aliases:
                alias.grad = p.grad
            self.shadow.step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p, src=owner)
