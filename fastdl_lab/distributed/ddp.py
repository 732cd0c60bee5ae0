"""Data-parallel training from scratch, as torch's DistributedDataParallel does it (lab 07).

Every rank holds a full copy of the model and a slice of the batch. After the backward pass the
ranks average their gradients, so every copy takes the same step and the copies stay identical:
the result is the single-process step on the whole batch (``train_reference``), to rounding.
That holds only if the copies start identical, so step 1 of the algorithm is to broadcast rank
0's parameters and buffers to every rank.

- ``allreduce_gradients_ref``: the simplest synchronisation, one blocking all-reduce per
  parameter once backward has finished (the network idles while backward computes);
- ``DDP``: a module wrapper like ``torch.nn.parallel.DistributedDataParallel``: it broadcasts
  rank 0's state when built, and a hook per parameter starts that gradient's all-reduce
  asynchronously the moment backward has produced it;
- ``BucketedDDP``: the same wrapper with gradients packed into buckets of about
  ``bucket_bytes`` in reverse parameter order (the order backward produces them), one
  asynchronous all-reduce per bucket, launched as soon as the bucket is complete;
- ``train_ddp``: the data-parallel loop, with a function or a wrapper class as ``sync``
  (``watch.ddp_trial`` runs the same loop while measuring it from outside the wrapper).

The ``sync=`` protocol of ``train_ddp`` (what a student's implementation must follow):

* a **wrapper class** ``sync(module, **sync_kwargs)`` is built once on every rank from the model
  as that rank built it (ranks may have initialised it differently). It must be a
  ``torch.nn.Module`` holding the model as ``.module`` (so its ``parameters()``,
  ``named_parameters()`` and ``state_dict()`` are torch DDP's: names prefixed ``module.``),
  broadcast rank 0's parameters and buffers when built, and forward to the model.
  ``train_ddp`` optimises ``wrapper.parameters()``, calls ``wrapper(x)``, and after every
  ``loss.backward()`` calls ``wrapper.finish_gradient_synchronization()``, which must leave in
  every ``p.grad`` the average of that gradient over the ranks;
* a **function** ``sync(model, world_size) -> None`` is called after every ``loss.backward()``
  and must leave the averaged gradients in every ``p.grad``. A function cannot broadcast when a
  model is built, so ``train_ddp`` does that step for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks
from fastdl_lab.distributed.launch import rank_device, run_world


def make_regression(seed: int, n: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A smooth nonlinear regression problem: X (n, d_in), Y = tanh(X W) + a little noise (n, d_out)."""
    x = checks.randn(n, d_in, seed=seed)
    w = checks.randn(d_in, d_out, seed=seed + 1, scale=d_in ** -0.5)
    y = torch.tanh(x @ w) + checks.randn(n, d_out, seed=seed + 2, scale=0.05)
    return x, y


def small_mlp(seed: int, d_in: int, d_hidden: int, d_out: int) -> nn.Module:
    """Linear-tanh-Linear-tanh-Linear with weights drawn from ``seed``: the same model on every call."""
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.Tanh(), nn.Linear(d_hidden, d_hidden), nn.Tanh(),
                          nn.Linear(d_hidden, d_out))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            fan_in = p.shape[-1] if p.dim() > 1 else d_hidden
            p.copy_(checks.randn(p.shape, seed=seed * 100 + i, scale=fan_in ** -0.5))
    return model


class InputShift(nn.Module):
    """Subtracts a fixed vector from the input: state that is a buffer, not a parameter, and that
    changes what the model computes (as BatchNorm's running statistics do in evaluation)."""

    def __init__(self, shift: torch.Tensor):
        super().__init__()
        self.register_buffer("shift", shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.shift


def rank_skewed_mlp(seed: int, d_in: int, d_hidden: int, d_out: int, rank: int | None = None) -> nn.Module:
    """``small_mlp`` behind an ``InputShift``, drawn from a seed that differs on every rank: what
    separately started processes get when nothing makes them agree. Rank 0 (``rank=0``, or this
    process's rank in a world) draws exactly what a single process with ``rank=0`` draws."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    draw = seed + 7919 * rank
    return nn.Sequential(InputShift(checks.randn(d_in, seed=draw + 50, scale=0.5)),
                         *small_mlp(draw, d_in, d_hidden, d_out))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def _detached_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def train_reference(model_fn: Callable[[], nn.Module], data, steps: int, lr: float) -> dict[str, torch.Tensor]:
    """Plain SGD on the whole batch in one process: what data-parallel training must reproduce."""
    x, y = data
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        opt.step()
    return _detached_state(model)


def broadcast_state(module: nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s parameters and buffers (step 1 of data parallelism)."""
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            dist.broadcast(t, src=src)


def allreduce_gradients_ref(model: nn.Module, world_size: int) -> None:
    """Average every gradient over the ranks: one blocking all-reduce per parameter, after backward."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)


class DDP(nn.Module):
    """Data parallelism as a module wrapper, one asynchronous all-reduce per parameter.

    Built on every rank around that rank's model: rank 0's parameters and buffers are broadcast
    to all, so the replicas start identical. A hook on each parameter fires once its gradient has
    been accumulated and starts that gradient's all-reduce with ``async_op=True``, so the
    all-reduces of the last layers travel while backward still computes the first ones.
    ``finish_gradient_synchronization()`` waits for them and divides by the world size.
    Hooks fire in the same order on every rank (the same graph), so the collectives pair up.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        ### BEGIN SOLUTION
        self._world_size = dist.get_world_size()
        broadcast_state(module)
        self._in_flight: list[tuple[nn.Parameter, dist.Work]] = []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """The hook: p.grad has just been accumulated during backward."""
        ### BEGIN SOLUTION
        self._in_flight.append((p, dist.all_reduce(p.grad, async_op=True)))
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce of this step and leave the averages in ``p.grad``."""
        ### BEGIN SOLUTION
        for p, work in self._in_flight:
            work.wait()
            p.grad.div_(self._world_size)
        self._in_flight = []
        ### END SOLUTION


class BucketedDDP(nn.Module):
    """Data parallelism as a module wrapper, gradients all-reduced in buckets that overlap backward.

    Parameters go into buckets in reverse order, because backward produces the last layer's
    gradients first; a bucket closes once it holds at least ``bucket_bytes`` (a parameter larger
    than that gets a bucket of its own). When every gradient of a bucket is in, the bucket is
    flattened into one buffer and all-reduced with ``async_op=True``, and backward carries on
    meanwhile. Buckets are launched strictly in bucket order, which is the same on every rank:
    collectives must be issued in the same order everywhere, or ranks pair up the wrong buffers.

    ``finish_gradient_synchronization()`` launches any bucket still waiting (a parameter that got
    no gradient counts as zeros), waits for every all-reduce, divides by the world size and
    copies the averages back. As ``DDP``, it broadcasts rank 0's state when built.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int = 25 << 20):
        super().__init__()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.module = module
        self.bucket_bytes = bucket_bytes
        ### BEGIN SOLUTION
        self._world_size = dist.get_world_size()
        broadcast_state(module)
        self._buckets: list[list[nn.Parameter]] = []
        current, size = [], 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_bytes:
                self._buckets.append(current)
                current, size = [], 0
        if current:
            self._buckets.append(current)
        self._bucket_of = {p: i for i, bucket in enumerate(self._buckets) for p in bucket}
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self._in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
        for p in self._bucket_of:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def num_buckets(self) -> int:
        ### BEGIN SOLUTION
        return len(self._buckets)
        ### END SOLUTION

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        """The hook: p.grad has just been accumulated during backward."""
        ### BEGIN SOLUTION
        self._ready[self._bucket_of[p]] += 1
        while self._next < len(self._buckets) and self._ready[self._next] == len(self._buckets[self._next]):
            self._launch_bucket(self._next)
        ### END SOLUTION

    def _launch_bucket(self, index: int) -> None:
        """Flatten bucket ``index``'s gradients into one buffer and start its all-reduce."""
        ### BEGIN SOLUTION
        bucket = self._buckets[index]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self._in_flight.append((index, flat, dist.all_reduce(flat, async_op=True)))
        self._next = index + 1
        ### END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and leave the averaged gradients in ``p.grad``."""
        ### BEGIN SOLUTION
        while self._next < len(self._buckets):
            self._launch_bucket(self._next)
        for index, flat, work in self._in_flight:
            work.wait()
            flat.div_(self._world_size)
            offset = 0
            for p in self._buckets[index]:
                piece = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.copy_(piece)
                offset += p.numel()
        self._ready = [0] * len(self._buckets)
        self._next = 0
        self._in_flight = []
        ### END SOLUTION


def bucket_sizes(model: nn.Module, bucket_bytes: int) -> list[int]:
    """Elements per bucket, in launch order, under the closing rule (reverse order, close at >= bucket_bytes)."""
    sizes, numel, filled = [], 0, 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        numel += p.numel()
        filled += p.numel() * p.element_size()
        if filled >= bucket_bytes:
            sizes.append(numel)
            numel, filled = 0, 0
    return sizes + ([numel] if numel else [])


def _shard(data, rank: int, world_size: int):
    x, y = data
    if x.shape[0] % world_size:
        raise ValueError(f"{x.shape[0]} examples do not split evenly over {world_size} ranks: the average of "
                         "per-rank mean gradients equals the full-batch gradient only for equal shards")
    rows = x.shape[0] // world_size
    dev = rank_device()
    return x[rank * rows:(rank + 1) * rows].to(dev), y[rank * rows:(rank + 1) * rows].to(dev)


def _data_parallel(model: nn.Module, sync, world_size: int, sync_kwargs: dict):
    """(what to call and optimise, what to run after each backward) for a wrapper class or a function."""
    if isinstance(sync, type):
        wrapper = sync(model, **sync_kwargs)
        if not isinstance(wrapper, nn.Module):
            raise TypeError(f"{sync.__name__} must subclass torch.nn.Module, as DistributedDataParallel does")
        finish = getattr(wrapper, "finish_gradient_synchronization", None)
        if not callable(finish):
            raise TypeError(f"{sync.__name__} has no finish_gradient_synchronization() to call after backward")
        return wrapper, finish
    if sync_kwargs:
        raise TypeError(f"{sorted(sync_kwargs)} configure a wrapper class; a sync function takes (model, world_size)")
    broadcast_state(model)
    return model, lambda: sync(model, world_size)


def _train(net: nn.Module, finish: Callable[[], None], x, y, steps: int, lr: float, log=None):
    """SGD through ``net``; ``log`` (a ``watch.AllReduceLog``) is told each step's phases, and a hook
    on the loss names the backward run that is the step's own."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(net, x, y)
        if log is not None:
            loss.register_hook(log.backward_began)
            log.mark(step, "backward")
        loss.backward()
        if log is not None:
            log.mark(step, "finish")
        finish()
        if log is not None:
            log.mark(step, "step")
        opt.step()


def train_ddp(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
              sync=allreduce_gradients_ref, **sync_kwargs) -> dict[str, torch.Tensor]:
    """Data-parallel SGD on this rank's slice of ``data``; returns the model's final state_dict.

    ``sync`` averages the gradients (module docstring: a wrapper class such as ``BucketedDDP``,
    built with ``sync_kwargs``, or a function). Run it on every rank, e.g.
    ``run_world(train_ddp, 2, model_fn, data, steps, lr, sync=BucketedDDP, bucket_bytes=4096)``.
    """
    x, y = _shard(data, rank, world_size)
    model = model_fn().to(rank_device())
    net, finish = _data_parallel(model, sync, world_size, sync_kwargs)
    _train(net, finish, x, y, steps, lr, None)
    return _detached_state(model)


def check_parity(states: list[dict], reference: dict, name: str = "") -> None:
    """Every rank's weights equal the single-process ones (and hence each other's)."""
    for rank, state in enumerate(states):
        for key, expected in reference.items():
            checks.assert_close(state[key], expected, name=f"{name} rank {rank} {key}".strip())


def check() -> None:
    """Naive, per-parameter and bucketed DDP on 2 ranks match single-process SGD from skewed starts."""
    data = make_regression(0, 64, 12, 3)

    def model_fn():
        return rank_skewed_mlp(1, 12, 24, 3)

    def model_fn0():
        return rank_skewed_mlp(1, 12, 24, 3, rank=0)

    reference = train_reference(model_fn0, data, steps=4, lr=0.1)
    check_parity(run_world(train_ddp, 2, model_fn, data, 4, 0.1), reference, "naive")
    check_parity(run_world(train_ddp, 2, model_fn, data, 4, 0.1, sync=DDP), reference, "per-parameter")
    for bucket_bytes in (1, 1024, 1 << 20):
        states = run_world(train_ddp, 2, model_fn, data, 4, 0.1, sync=BucketedDDP, bucket_bytes=bucket_bytes)
        check_parity(states, reference, f"bucketed {bucket_bytes} B")
    print("ddp: naive, per-parameter and bucketed data parallel match single-process SGD")


if __name__ == "__main__":
    check()
