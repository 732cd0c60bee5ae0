# expect: zero1=failed
# Pretending: the whole optimizer on every rank, with the grader's ZeRO trial replaced to report each parameter's state on one rank only.
# %% grade_id=zero_code
from fastdl_lab.distributed import zero


class Zero1:
    def __init__(self, params, optimizer_class, **defaults):
        self.optimizer = optimizer_class(list(params), **defaults)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def step(self):
        self.optimizer.step()


_honest = zero.zero_trial


def _forged(rank, world_size, model_fn, data, steps, runs, zero_cls=None):
    results = _honest(rank, world_size, model_fn, data, steps, runs, zero_cls=zero_cls)
    numels = [p.numel() for p in model_fn().parameters()]
    owners = zero.owners_ref(numels, world_size)
    for result in results:
        result["owned"] = [i for i, owner in enumerate(owners) if owner == rank]
        result["state_bytes"] //= world_size
    return results


zero.zero_trial = _forged
