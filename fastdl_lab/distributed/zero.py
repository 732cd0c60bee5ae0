"""ZeRO stage 1: Adam whose state is split across the data-parallel ranks (lab 07).

Plain data parallelism keeps a full copy of everything on every rank. With Adam in mixed
precision that is 16 bytes per parameter (Rajbhandari et al., 2020): 2 for fp16 weights, 2 for
fp16 gradients, and 12 of optimizer state (fp32 master weights, first and second moments). The
state is the largest part and nothing requires every rank to hold all of it: a rank only needs
the state of the parameters it updates. ZeRO-1 therefore

1. flattens the parameters into one vector, padded to a multiple of N, and gives rank r the
   r-th of N equal shards;
2. **reduce-scatters** the gradients, so that rank r receives the sum of everyone's gradients for
   its shard only (half an all-reduce);
3. runs Adam on its shard, with exp_avg and exp_avg_sq for that shard only;
4. **all-gathers** the updated shards, so that every rank again holds all the parameters (the
   other half of the all-reduce).

The traffic equals plain data parallelism's all-reduce; the optimizer state per rank drops from
S to S / N. Here everything is fp32, so the state is 8 bytes per parameter (the weights are the
model's own), and ``optimizer_state_bytes()`` is about 8 P / N. Stage 2 also shards gradients,
stage 3 the parameters themselves (PyTorch's FSDP).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from fastdl_lab import checks
from fastdl_lab.distributed.ddp import _loss, _shard, make_regression, small_mlp
from fastdl_lab.distributed.launch import rank_device, run_world


class Zero1Adam:
    """Adam (as ``torch.optim.Adam``, no weight decay) with its state sharded over the ranks.

    Call it on every rank after each rank's ``backward()``: ``step()`` averages the gradients
    over the ranks itself, so no other gradient synchronisation is needed.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        # Equal shards for the collectives: the flat vector is padded to a multiple of N.
        self.shard_size = math.ceil(self.numel / self.world_size)
        self.shard_start = self.rank * self.shard_size
        like = self.params[0]
        self.exp_avg = torch.zeros(self.shard_size, dtype=like.dtype, device=like.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.shard_size * self.world_size - self.numel)])

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter the gradients, update this rank's shard with Adam, all-gather the weights."""
        ### BEGIN SOLUTION
        grads = self._flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        grad = torch.empty(self.shard_size, dtype=grads.dtype, device=grads.device)
        dist.reduce_scatter(grad, list(grads.split(self.shard_size)), op=dist.ReduceOp.SUM)
        grad.div_(self.world_size)

        self.steps += 1
        beta1, beta2 = self.betas
        self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias1 = 1 - beta1 ** self.steps
        bias2 = 1 - beta2 ** self.steps
        denom = (self.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(self.eps)
        weights = self._flat([p.detach() for p in self.params])
        shard = weights[self.shard_start:self.shard_start + self.shard_size]
        shard.addcdiv_(self.exp_avg, denom, value=-self.lr / bias1)

        dist.all_gather(list(weights.split(self.shard_size)), shard.clone())
        offset = 0
        for p in self.params:
            p.copy_(weights[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        ### END SOLUTION

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: its shard of exp_avg and exp_avg_sq."""
        return sum(t.numel() * t.element_size() for t in (self.exp_avg, self.exp_avg_sq))


def adam_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in a torch optimizer's state (exp_avg, exp_avg_sq and step counters)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def train_adam_reference(model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
                         eps: float = 1e-8) -> dict:
    """Full-batch ``torch.optim.Adam`` in one process: the weights, and its state bytes."""
    x, y = data
    model = model_fn()
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "state_bytes": adam_state_bytes(opt)}


def train_zero(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
               optimizer_cls=Zero1Adam, eps: float = 1e-8) -> dict:
    """Data-parallel training with a ZeRO-1 optimizer on this rank's slice of the batch.

    ``optimizer_cls(params, lr=lr, eps=eps)`` must average gradients itself in ``step()``.
    Returns the final weights and this rank's ``optimizer_state_bytes()``. Adam's update
    hardly changes when every gradient is scaled by the same factor, so a large ``eps`` is what
    exposes gradients summed over the ranks instead of averaged.
    """
    x, y = _shard(data, rank, world_size)
    model = model_fn().to(rank_device())
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    opt = optimizer_cls(model.parameters(), lr=lr, eps=eps)
    for _ in range(steps):
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "state_bytes": opt.optimizer_state_bytes()}


def check_zero(results: list[dict], reference: dict, name: str = "ZeRO-1") -> None:
    """Weights equal Adam's on every rank; each rank's state is the moments of its 1/N share.

    The moments of P parameters are 2 P elements; a rank may hold up to N - 1 elements of
    padding per moment, nothing more, and torch's Adam also stores one step counter per tensor.
    """
    world_size = len(results)
    for rank, result in enumerate(results):
        for key, expected in reference["state"].items():
            checks.assert_close(result["state"][key], expected, atol=1e-5, rtol=1e-4,
                                name=f"{name} rank {rank} {key}")
    numel = sum(t.numel() for t in reference["state"].values())
    element = next(iter(reference["state"].values())).element_size()
    for rank, result in enumerate(results):
        low, high = 2 * numel * element / world_size, 2 * (numel / world_size + world_size) * element
        if not low <= result["state_bytes"] <= high:
            raise checks.MismatchError(f"{name} rank {rank}: {result['state_bytes']} bytes of optimizer state; "
                                       f"a 1/{world_size} share of Adam's moments is {low:.0f} to {high:.0f} bytes")


def check() -> None:
    """Three steps of ZeRO-1 on 2 ranks equal full-batch Adam; each rank holds half the moments."""
    data = make_regression(2, 48, 10, 3)

    def model_fn():
        return small_mlp(3, 10, 20, 3)

    reference = train_adam_reference(model_fn, data, 3, 0.01)
    results = run_world(train_zero, 2, model_fn, data, 3, 0.01)
    check_zero(results, reference)
    print(f"zero: ZeRO-1 matches Adam; state per rank {results[0]['state_bytes']} B "
          f"of Adam's {reference['state_bytes']} B")


if __name__ == "__main__":
    check()
