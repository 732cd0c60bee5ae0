"""Data-parallel training seen from outside the wrapper: what the grader and the lab measure (lab 07).

A DDP wrapper could report anything about itself; these figures are taken by code that never
asks it. ``allreduce_log`` wraps the process group's own all-reduce methods (below
torch.distributed's functions, where every call arrives whatever name the caller used) and notes
each call's size, the training step and whether it started inside the training loop's own
backward pass; ``ddp_trial`` runs ``ddp.train_ddp``'s loop under it and also records the state
each rank started from and how the wrapper looks to code written for torch's DDP.
``check_trials`` and ``overlap_problem`` judge what a trial saw, ``timeline`` lays one step out
on a time axis, and ``time_step`` times a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn
from torch._C import _distributed_c10d as c10d

from fastdl_lab import checks
from fastdl_lab.distributed import bench_in_rank
from fastdl_lab.distributed.ddp import (DDP, _data_parallel, _detached_state, _loss, _shard, _train,
                                        allreduce_gradients_ref, check_parity)
from fastdl_lab.distributed.launch import rank_device


class AllReduceLog:
    """Every all-reduce the process group was asked for while ``allreduce_log()`` lasted: elements,
    training step, phase, launch and completion times in seconds. The phase is ``backward`` only
    for a call made inside the autograd run of the training loop's own ``loss.backward()`` (the
    loop names that run from a hook on the loss; a backward of some other graph does not count);
    otherwise it is where the loop was: ``construct``, ``finish`` or ``step``."""

    def __init__(self):
        self._t0 = time.perf_counter()
        self.step, self.phase = -1, "construct"
        self.backward_task = None
        self.calls: list[dict] = []
        self.marks: list[tuple[int, str, float]] = []

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def mark(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self.marks.append((step, phase, self.now()))

    def backward_began(self, grad: torch.Tensor) -> None:
        """A hook on the loss: the first thing its backward runs, inside that run's graph task."""
        self.backward_task = torch._C._current_graph_task_id()

    def phase_now(self) -> str:
        task = torch._C._current_graph_task_id()
        if task != -1 and task == self.backward_task:
            return "backward"
        return "outside backward" if self.phase == "backward" else self.phase


@contextlib.contextmanager
def allreduce_log():
    """While it lasts, log every all-reduce below torch.distributed's functions (the process
    group's own methods), where a wrapper's calls are seen whatever name it used for them."""
    log = AllReduceLog()
    originals = {name: getattr(c10d.ProcessGroup, name) for name in ("allreduce", "allreduce_coalesced")}

    def logging(original):
        def logged(group, tensors, *args, **kwargs):
            numel = sum(t.numel() for t in tensors) if isinstance(tensors, (list, tuple)) else tensors.numel()
            entry = {"numel": int(numel), "step": log.step, "phase": log.phase_now(), "launched_s": log.now(),
                     "done_s": None}
            log.calls.append(entry)
            work = original(group, tensors, *args, **kwargs)
            with contextlib.suppress(RuntimeError):
                work.get_future().then(lambda _: entry.update(done_s=log.now()))
            return work
        return logged

    for name, original in originals.items():
        setattr(c10d.ProcessGroup, name, logging(original))
    try:
        yield log
    finally:
        for name, original in originals.items():
            setattr(c10d.ProcessGroup, name, original)


def _facts(wrapper: nn.Module, model: nn.Module) -> dict:
    """How the wrapper looks to code written for torch's DDP."""
    if wrapper is model:
        return {}
    return {"state_dict_keys": list(wrapper.state_dict()),
            "parameter_names": [name for name, _ in wrapper.named_parameters()],
            "same_parameters": [id(p) for p in wrapper.parameters()] == [id(p) for p in model.parameters()]}


def ddp_trial(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
              sync=DDP, **sync_kwargs) -> dict:
    """``train_ddp`` seen from outside the wrapper, by code that never asks the wrapper for a figure.

    Returns {"start": the model's state once the wrapper was built, "state": its final state,
    "allreduces": every all-reduce (``AllReduceLog.calls``), "marks": when each step's backward
    and synchronisation began, "facts": the wrapper's state_dict keys, parameter names, and
    whether its parameters() are the model's own}.
    """
    x, y = _shard(data, rank, world_size)
    model = model_fn().to(rank_device())
    with allreduce_log() as log:
        net, finish = _data_parallel(model, sync, world_size, sync_kwargs)
        start = _detached_state(model)
        facts = _facts(net, model)
        _train(net, finish, x, y, steps, lr, log)
    return {"start": start, "state": _detached_state(model), "allreduces": log.calls, "marks": log.marks,
            "facts": facts}


def time_step(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, sync=allreduce_gradients_ref,
              reps: int = 10, **sync_kwargs) -> dict:
    """Time one data-parallel SGD step on this rank: median and IQR in seconds, all-reduces per step."""
    x, y = _shard(data, rank, world_size)
    model = model_fn().to(rank_device())
    with allreduce_log() as log:
        net, finish = _data_parallel(model, sync, world_size, sync_kwargs)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        steps = [0]

        def step():
            opt.zero_grad(set_to_none=True)
            _loss(net, x, y).backward()
            finish()
            opt.step()
            steps[0] += 1

        t = bench_in_rank(step, reps=reps)
    return {"median_s": t.median, "iqr_s": t.iqr, "calls_per_step": len(log.calls) // steps[0]}


def timeline(trial: dict, step: int) -> dict:
    """One step of a ``ddp_trial`` on a time axis, in milliseconds from the start of its backward:
    {"backward": (start, end), "step": when the optimizer step began, "allreduces": [(launch,
    completion, elements)] in launch order}. An all-reduce whose completion was not seen ends at
    the optimizer step (the synchronisation had waited for it by then)."""
    marks = {phase: t for s, phase, t in trial["marks"] if s == step}
    if not {"backward", "finish", "step"} <= set(marks):
        raise ValueError(f"the trial has no step {step}")
    origin = marks["backward"]

    def ms(t: float) -> float:
        return (t - origin) * 1e3

    calls = [c for c in trial["allreduces"] if c["step"] == step]
    return {"backward": (0.0, ms(marks["finish"])), "step": ms(marks["step"]),
            "allreduces": [(ms(c["launched_s"]), ms(c["done_s"] if c["done_s"] is not None else marks["step"]),
                            c["numel"]) for c in calls]}


def check_trials(trials: list[dict], model_fn0: Callable[[], nn.Module], reference: dict, name: str = "") -> None:
    """What a DDP wrapper must get right, checked from ``ddp_trial`` results, first failure named:
    torch DDP's names, every rank starting from rank 0's parameters and buffers, replicas that
    stay identical, and the single-process weights. ``model_fn0`` builds rank 0's model."""
    model = model_fn0()
    start = _detached_state(model)
    keys = [f"module.{k}" for k in model.state_dict()]
    names = [f"module.{n}" for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    # Parameters first: a wrapper that broadcasts nothing is told about its parameters.
    order = [n for n, _ in model.named_parameters()] + buffers
    prefix = f"{name} " if name else ""
    for rank, trial in enumerate(trials):
        facts = trial["facts"]
        if list(facts.get("state_dict_keys", ())) != keys:
            raise checks.MismatchError(f"{prefix}state_dict() keys {list(facts.get('state_dict_keys', ()))[:3]}...; "
                                       f"torch's DDP gives the model's keys under 'module.' ({keys[:2]}...)")
        if list(facts.get("parameter_names", ())) != names or facts.get("same_parameters") is not True:
            raise checks.MismatchError(f"{prefix}named_parameters() must be the wrapped model's own parameters, "
                                       f"named as torch's DDP names them ({names[:2]}...)")
        for key in order:
            expected, got = start[key], trial["start"].get(key)
            if not isinstance(got, torch.Tensor) or not torch.equal(got, expected):
                what = "buffer" if key in buffers else "parameter"
                raise checks.MismatchError(
                    f"{prefix}rank {rank} does not start from rank 0's {what} {key}: ranks are initialised "
                    f"differently here, and the wrapper must broadcast rank 0's parameters and buffers when built")
    check_parity([t["state"] for t in trials], reference, name)


def overlap_problem(trials: list[dict], expected: list[int], steps: int, ordered: bool) -> tuple[str, str] | None:
    """What is wrong with the all-reduces ``ddp_trial`` logged, if anything: ``("layout", why)``
    unless every step has one all-reduce per expected unit (``expected`` elements each, in this
    order if ``ordered``); ``("late", why)`` unless all of them started during backward."""
    def shown(sizes: list[int]) -> str:
        return f"{sizes[:8]}{'...' if len(sizes) > 8 else ''}"

    for rank, trial in enumerate(trials):
        for step in range(steps):
            calls = [c for c in trial["allreduces"] if c["step"] == step]
            sizes = [int(c["numel"]) for c in calls]
            if (sizes if ordered else sorted(sizes)) != (expected if ordered else sorted(expected)):
                return "layout", (f"rank {rank}, step {step}: all-reduces of {shown(sizes)} elements; expected "
                                  f"{shown(expected)}")
            late = [c for c in calls if c["phase"] != "backward"]
            if late:
                return "late", (f"rank {rank}, step {step}: {len(late)} of {len(calls)} all-reduces started outside "
                                "backward (no overlap: launch them from the gradient hooks)")
    return None


def check() -> None:
    """Seen from outside on 2 ranks that start apart: both wrappers start every rank from rank 0's
    state, match single-process SGD, and launch one all-reduce per parameter or bucket in backward."""
    from fastdl_lab.distributed.ddp import (BucketedDDP, bucket_sizes, make_regression,
                                            rank_skewed_mlp, train_reference)
    from fastdl_lab.distributed.launch import run_world

    data = make_regression(0, 32, 12, 3)

    def model_fn():
        return rank_skewed_mlp(1, 12, 24, 3)

    def model_fn0():
        return rank_skewed_mlp(1, 12, 24, 3, rank=0)

    reference = train_reference(model_fn0, data, 2, 0.1)
    trials = run_world(ddp_trial, 2, model_fn, data, 2, 0.1, sync=DDP)
    check_trials(trials, model_fn0, reference, "per-parameter")
    problem = overlap_problem(trials, [p.numel() for p in model_fn0().parameters()], 2, ordered=False)
    assert problem is None, problem
    trials = run_world(ddp_trial, 2, model_fn, data, 2, 0.1, sync=BucketedDDP, bucket_bytes=1024)
    check_trials(trials, model_fn0, reference, "bucketed")
    problem = overlap_problem(trials, bucket_sizes(model_fn0(), 1024), 2, ordered=True)
    assert problem is None, problem
    print("watch: both wrappers broadcast, match single-process SGD and overlap their all-reduces with backward")


if __name__ == "__main__":
    check()
