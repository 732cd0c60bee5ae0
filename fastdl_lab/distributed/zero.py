"""ZeRO stage 1: any torch optimizer with its state sharded across the data-parallel ranks (lab 07).

Plain data parallelism keeps a full copy of everything on every rank. With Adam in mixed
precision that is 16 bytes per parameter (Rajbhandari et al., 2020): 2 for fp16 weights, 2 for
fp16 gradients, and 12 of optimizer state (fp32 master weights, first and second moments). The
state is the largest part and nothing requires every rank to hold all of it: a rank only needs
the state of the parameters it updates. ``Zero1`` therefore, as torch's
``ZeroRedundancyOptimizer`` does,

1. partitions the parameters among the ranks, whole tensors, balancing the elements each rank
   owns (largest first, each to the least-loaded rank);
2. builds the real optimizer (``optimizer_class(my_params, **defaults)``) over this rank's
   parameters only, so its state exists for 1/N of the model;
3. after the gradients have been averaged (by data parallelism, as usual), steps its own
   parameters with that optimizer, then **broadcasts** each parameter from its owner, so that
   every rank again holds all the new weights.

Because each parameter is updated by the very optimizer class, on the same tensor, with the same
gradient, the weights are bit-identical to the unsharded optimizer's: ``check_zero`` compares
with ``torch.equal``. The broadcasts add one copy of the weights to the traffic; the ZeRO paper's
stage 1 saves it by replacing data parallelism's all-reduce with its two halves, a
reduce-scatter of the gradients before the step and an all-gather of the weights after it.
Stage 2 also shards gradients, stage 3 the parameters themselves (PyTorch's FSDP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, register_optimizer_step_post_hook

from fastdl_lab import checks
from fastdl_lab.distributed.ddp import (_detached_state, _loss, _shard, allreduce_gradients_ref, broadcast_state,
                                        make_regression, small_mlp)
from fastdl_lab.distributed.launch import rank_device, run_world

# The optimizer classes a grader may name in its inputs (inputs carry names, not classes).
OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {OPTIMIZERS}")
    return getattr(torch.optim, name)


def owners_ref(numels: list[int], world_size: int) -> list[int]:
    """Which rank owns each parameter: largest first (ties by position), each to the rank that
    owns the fewest elements so far (ties to the lower rank)."""
    ### BEGIN SOLUTION
    owners, load = [0] * len(numels), [0] * world_size
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += numels[i]
    return owners
    ### END SOLUTION


class Zero1:
    """``optimizer_class`` with its state sharded over the ranks, as ``ZeroRedundancyOptimizer``.

    ``Zero1(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)``
    on every rank. Gradients must already be averaged over the ranks when ``step()`` is called
    (a DDP wrapper, or ``ddp.allreduce_gradients_ref``); ``step()`` updates this rank's
    parameters and broadcasts every parameter from its owner.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], **defaults):
        self.params = list(params)
        if any(not isinstance(p, torch.Tensor) for p in self.params):
            raise TypeError("Zero1 takes an iterable of tensors (parameter groups as dicts are not supported)")
        self.params = [p for p in self.params if p.requires_grad]
        if not self.params:
            raise ValueError("Zero1 got no parameter that requires a gradient")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION
        self.owners = owners_ref([p.numel() for p in self.params], self.world_size)
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        # A rank that owns nothing (more ranks than parameters) has no optimizer at all.
        self.optimizer = optimizer_class(mine, **defaults) if mine else None
        ### END SOLUTION

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's parameters with the real optimizer, then broadcast each from its owner."""
        ### BEGIN SOLUTION
        if self.optimizer is not None:
            self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p, src=owner)
        ### END SOLUTION


class StateWatch:
    """Optimizer state seen from outside: which of ``params`` hold state in each optimizer that
    has just stepped, and its bytes (each tensor once), looked at by torch's global step hook
    as every ``step()`` returns, before its caller can move the state elsewhere. It watches from
    inside the process: an optimizer's own post-step hooks run before it, and updates made with
    torch's functional optimizers (no ``Optimizer`` object) are not seen."""

    def __init__(self, params: list[torch.Tensor]):
        self._index = {id(p): i for i, p in enumerate(params)}
        self._bytes: dict[tuple[int, int], int] = {}  # (optimizer, parameter) -> most bytes seen
        self._keep: list[torch.optim.Optimizer] = []  # alive while watched, so ids stay unique

    def observe(self, optimizer: torch.optim.Optimizer, args=(), kwargs=None) -> None:
        if all(o is not optimizer for o in self._keep):
            self._keep.append(optimizer)
        try:
            states = list(dict.items(optimizer.state))
        except Exception:  # noqa: BLE001 - a subclass whose state is not a dict holds none we can count
            return
        seen: set[int] = set()
        for p, state in states:
            i = self._index.get(id(p))
            if i is None or not isinstance(state, dict):
                continue
            nbytes = 0
            for t in state.values():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    nbytes += t.numel() * t.element_size()
            key = (id(optimizer), i)
            if nbytes:
                self._bytes[key] = max(nbytes, self._bytes.get(key, 0))

    def held(self) -> dict:
        return {"owned": sorted({i for _, i in self._bytes}), "state_bytes": sum(self._bytes.values())}


@contextlib.contextmanager
def watching_optimizers(params: list[torch.Tensor], opt_class: type[torch.optim.Optimizer]):
    """A ``StateWatch`` over ``params`` for as long as this lasts. One throwaway ``opt_class`` is
    built first: torch hooks a class's ``step`` when its first instance is made, so a subclass
    whose own ``step`` calls ``opt_class.step`` is observed right after the real update too."""
    watch = StateWatch(params)
    opt_class([torch.zeros(1, requires_grad=True)], lr=0.0)
    handle = register_optimizer_step_post_hook(watch.observe)
    # Ahead of any global hook registered before this one.
    _global_optimizer_post_hooks.move_to_end(handle.id, last=False)
    try:
        yield watch
    finally:
        handle.remove()


def _zero_run(rank: int, world_size: int, model_fn, data, steps: int, zero_cls, opt_class, defaults: dict) -> dict:
    x, y = _shard(data, rank, world_size)
    model = model_fn().to(rank_device())
    broadcast_state(model)
    params = list(model.parameters())
    opt = zero_cls(model.parameters(), optimizer_class=opt_class, **defaults)
    grads = []
    with watching_optimizers(params, opt_class) as watch:
        for _ in range(steps):
            for p in params:
                p.grad = None
            _loss(model, x, y).backward()
            allreduce_gradients_ref(model, world_size)
            grads.append([p.grad.clone() for p in params])
            opt.step()
    return {"state": _detached_state(model), "grads": grads, **watch.held()}


def zero_trial(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int,
               runs: list, zero_cls=Zero1) -> list[dict]:
    """ZeRO-1 training seen from outside the optimizer, once per (optimizer name, keyword arguments)
    in ``runs``, each from the same weights: for each, the final state, the averaged gradients
    every step fed to ``zero_cls`` (recorded before its ``step()``), and which parameters have
    optimizer state on this rank and how many bytes, as ``StateWatch`` saw them."""
    results = []
    for name, defaults in runs:
        results.append(_zero_run(rank, world_size, model_fn, data, steps, zero_cls, optimizer_class(name),
                                 dict(defaults)))
    return results


def train_zero(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int,
               optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, zero_cls=Zero1, **defaults) -> dict:
    """Data-parallel training of this rank's slice with ``zero_cls(params, optimizer_class, **defaults)``:
    the final weights, and the bytes of optimizer state this rank holds (``state_bytes``)."""
    result = _zero_run(rank, world_size, model_fn, data, steps, zero_cls, optimizer_class, defaults)
    return {"state": result["state"], "state_bytes": result["state_bytes"]}


def replay_reference(model_fn: Callable[[], nn.Module], grads: list, opt_class, defaults: dict) -> dict:
    """The unsharded optimizer fed the same gradients, in one process: its final weights, and the
    bytes of state it holds for each parameter."""
    model = model_fn()
    params = list(model.parameters())
    opt = opt_class(params, **defaults)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    per_param = [sum(t.numel() * t.element_size() for t in opt.state[p].values() if isinstance(t, torch.Tensor))
                 for p in params]
    return {"state": _detached_state(model), "state_bytes": per_param}


def _check_grads(result, params: list[torch.Tensor], steps: int, name: str) -> None:
    grads = result.get("grads") if isinstance(result, dict) else None
    if not isinstance(grads, list) or len(grads) != steps:
        raise checks.MismatchError(f"{name}: expected the gradients of {steps} steps")
    for step_grads in grads:
        if not isinstance(step_grads, list) or len(step_grads) != len(params) or any(
                not isinstance(g, torch.Tensor) or g.shape != p.shape or g.dtype != p.dtype
                for g, p in zip(step_grads, params)):
            raise checks.MismatchError(f"{name}: the recorded gradients do not match the model's parameters")


def check_states(results: list, expected_state: dict, start: dict, label: str, opt_name: str,
                 steps: int | None = None) -> None:
    """Every rank's returned ``state`` equals ``expected_state`` (the unsharded optimizer's) bit for
    bit; a tensor still at ``start`` is named as an update that was never broadcast."""
    during = f" in {steps} steps" if steps else ""
    after = f" after {steps} steps" if steps else ""
    for rank, result in enumerate(results):
        state = result.get("state", {}) if isinstance(result, dict) else {}
        for key, expected in expected_state.items():
            got = state.get(key) if isinstance(state, dict) else None
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
                raise checks.MismatchError(f"{label}: rank {rank} returned no {key} of the model's shape")
            if torch.equal(got, expected):
                continue
            if torch.equal(got, start[key]):
                raise checks.MismatchError(f"{label}: rank {rank}'s {key} never changed{during}: its owner's update "
                                           "must be broadcast to every rank")
            worst = (got.double() - expected.double()).abs().max().item()
            raise checks.MismatchError(f"{label}: rank {rank}'s {key} differs from torch.optim.{opt_name}'s by up to "
                                       f"{worst:.3g}{after}; bit-identical expected (step whole parameters with the "
                                       "optimizer class itself)")


def check_zero(results: list[dict], model_fn: Callable[[], nn.Module], opt_name: str, defaults: dict,
               steps: int, name: str = "Zero1") -> None:
    """Every rank's weights are bit for bit the unsharded optimizer's on rank 0's gradients, each
    parameter's state lives on exactly one rank, and no rank owns more elements than the
    largest-first partition gives its busiest rank."""
    opt_class = optimizer_class(opt_name)
    model = model_fn()
    params = list(model.parameters())
    start = _detached_state(model)
    world_size = len(results)
    _check_grads(results[0], params, steps, name)
    reference = replay_reference(model_fn, results[0]["grads"], opt_class, defaults)
    label = f"{name} ({opt_name} {', '.join(f'{k}={v}' for k, v in defaults.items())})"
    check_states(results, reference["state"], start, label, opt_name, steps)
    holders: list[list[int]] = [[] for _ in params]
    for rank, result in enumerate(results):
        for i in result.get("owned", []):
            if not isinstance(i, int) or not 0 <= i < len(params):
                raise checks.MismatchError(f"{label}: rank {rank} reported a parameter index out of range")
            holders[i].append(rank)
    names = [n for n, _ in model.named_parameters()]
    for i, ranks in enumerate(holders):
        if reference["state_bytes"][i] and len(ranks) != 1:
            where = f"ranks {ranks}" if ranks else "no rank"
            raise checks.MismatchError(f"{label}: {names[i]} has optimizer state on {where}; exactly one rank, its "
                                       "owner, must keep it")
    numels = [p.numel() for p in params]
    balanced = max(sum(n for n, r in zip(numels, owners_ref(numels, world_size)) if r == rank)
                   for rank in range(world_size))
    for rank in range(world_size):
        held = sum(numels[i] for i, ranks in enumerate(holders) if rank in ranks)
        if held > balanced:
            raise checks.MismatchError(f"{label}: rank {rank} keeps state for {held} of {sum(numels)} elements; the "
                                       f"largest-first partition keeps at most {balanced} on any rank")
    total = sum(r.get("state_bytes", 0) for r in results if isinstance(r, dict))
    if total != sum(reference["state_bytes"]):
        raise checks.MismatchError(f"{label}: the ranks hold {total} bytes of optimizer state together; "
                                   f"torch.optim.{opt_name} holds {sum(reference['state_bytes'])} for the model")


def check() -> None:
    """Three steps of ZeRO-1 on 2 and 3 ranks equal AdamW and SGD with momentum, bit for bit."""
    data = make_regression(2, 48, 10, 3)

    def model_fn():
        return small_mlp(3, 10, 20, 3)

    runs = [("AdamW", {"lr": 0.01, "weight_decay": 0.1}), ("SGD", {"lr": 0.05, "momentum": 0.9})]
    for world_size in (2, 3):
        per_rank = run_world(zero_trial, world_size, model_fn, data, 3, runs)
        for j, (opt_name, defaults) in enumerate(runs):
            check_zero([r[j] for r in per_rank], model_fn, opt_name, defaults, 3, f"{world_size} ranks")
    print("zero: ZeRO-1 equals AdamW and SGD bit for bit; each rank keeps the state of its own parameters")


if __name__ == "__main__":
    check()
