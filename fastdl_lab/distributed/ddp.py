"""Data-parallel training from scratch: naive all-reduce, then buckets that overlap backward (lab 07).

Every rank holds a full copy of the model and a slice of the batch. After the backward pass the
ranks average their gradients, so every copy takes the same step and the copies stay identical:
the result is the single-process step on the whole batch (``train_reference``), to rounding.

- ``allreduce_gradients_ref``: one all-reduce per parameter, after backward: correct, and every
  call pays the collective's fixed latency, and the network idles while backward computes;
- ``BucketedDDP``: packs gradients into buckets of about ``bucket_bytes`` in reverse parameter
  order (the order backward produces them), and starts each bucket's all-reduce asynchronously
  the moment its last gradient is accumulated, so communication overlaps the rest of backward;
- ``train_ddp``: the data-parallel loop, taking either kind of gradient synchronisation.

The ``sync=`` protocol of ``train_ddp`` (what a student's implementation must follow):

* a **function** ``sync(model, world_size) -> None`` is called after every ``loss.backward()``
  and must leave in every ``p.grad`` the average of that gradient over the ranks;
* a **class** is constructed once, ``sync(model, bucket_bytes)``, after the model is built and
  before its first forward pass (it may register hooks on the parameters); after every
  ``loss.backward()`` ``train_ddp`` calls its ``finish()``, which must leave the averaged
  gradients in every ``p.grad``. It counts the all-reduces it started in ``allreduce_calls``
  and reports its number of buckets in ``num_buckets``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks
from fastdl_lab.distributed import bench_in_rank
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


def allreduce_gradients_ref(model: nn.Module, world_size: int) -> None:
    """Average every gradient over the ranks: one blocking all-reduce per parameter."""
    ### BEGIN SOLUTION
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(world_size)
    ### END SOLUTION


class BucketedDDP:
    """Gradient averaging in buckets of about ``bucket_bytes``, overlapped with backward.

    Parameters go into buckets in reverse order, because backward produces the last layer's
    gradients first; a bucket closes once it holds at least ``bucket_bytes`` (a parameter larger
    than that gets a bucket of its own). A hook on each parameter fires when its gradient has
    been accumulated; when every gradient of a bucket is in, the bucket is flattened into one
    buffer and all-reduced with ``async_op=True``, and backward carries on meanwhile. Buckets are
    launched strictly in bucket order, which is the same on every rank: collectives must be
    issued in the same order everywhere, or ranks pair up the wrong buffers.

    ``finish()`` launches any bucket still waiting (a parameter that got no gradient counts as
    zeros), waits for every all-reduce, divides by the world size and copies the averages back.
    """

    def __init__(self, module: nn.Module, bucket_bytes: int):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.allreduce_calls = 0
        ### BEGIN SOLUTION
        self._world_size = dist.get_world_size()
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

    def __call__(self, *args, **kwargs):
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
        self.allreduce_calls += 1
        self._next = index + 1
        ### END SOLUTION

    def finish(self) -> None:
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


def _shard(data, rank: int, world_size: int):
    x, y = data
    if x.shape[0] % world_size:
        raise ValueError(f"{x.shape[0]} examples do not split evenly over {world_size} ranks: the average of "
                         "per-rank mean gradients equals the full-batch gradient only for equal shards")
    rows = x.shape[0] // world_size
    dev = rank_device()
    return x[rank * rows:(rank + 1) * rows].to(dev), y[rank * rows:(rank + 1) * rows].to(dev)


def _build(model_fn, sync, bucket_bytes):
    model = model_fn().to(rank_device())
    # Every rank must start from the same weights: rank 0's win, as in torch's DDP.
    with torch.no_grad():
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    wrapper = sync(model, bucket_bytes) if isinstance(sync, type) else None
    return model, wrapper


def train_ddp(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
              sync=allreduce_gradients_ref, bucket_bytes: int = 4096) -> dict[str, torch.Tensor]:
    """Data-parallel SGD on this rank's slice of ``data``; returns the final state_dict.

    ``sync`` averages the gradients (module docstring: a function, or a class such as
    ``BucketedDDP`` built with ``bucket_bytes``). Run it on every rank, e.g.
    ``run_world(train_ddp, 2, model_fn, data, steps, lr, sync=BucketedDDP)``.
    """
    x, y = _shard(data, rank, world_size)
    model, wrapper = _build(model_fn, sync, bucket_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        if wrapper is None:
            sync(model, world_size)
        else:
            wrapper.finish()
        opt.step()
    return _detached_state(model)


def bucket_stats(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, bucket_bytes: int,
                 sync=BucketedDDP, steps: int = 1) -> dict[str, int]:
    """Train ``steps`` steps with a bucketing class: its ``allreduce_calls`` and ``num_buckets``, and
    how many all-reduces it had started when the first backward returned (``launched_in_backward``:
    all of them when every bucket overlaps backward)."""
    x, y = _shard(data, rank, world_size)
    model, wrapper = _build(model_fn, sync, bucket_bytes)
    launched_in_backward = None
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        if launched_in_backward is None:
            launched_in_backward = wrapper.allreduce_calls
        wrapper.finish()
    return {"allreduce_calls": wrapper.allreduce_calls, "num_buckets": wrapper.num_buckets, "steps": steps,
            "launched_in_backward": launched_in_backward}


def time_step(rank: int, world_size: int, model_fn: Callable[[], nn.Module], data, sync=allreduce_gradients_ref,
              bucket_bytes: int = 4096, reps: int = 10) -> dict:
    """Time one data-parallel SGD step on this rank: median and IQR in seconds, all-reduces per step."""
    x, y = _shard(data, rank, world_size)
    model, wrapper = _build(model_fn, sync, bucket_bytes)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    naive_calls, steps = [0], [0]

    def step():
        opt.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        if wrapper is None:
            sync(model, world_size)
            naive_calls[0] += sum(p.grad is not None for p in model.parameters())
        else:
            wrapper.finish()
        opt.step()
        steps[0] += 1

    t = bench_in_rank(step, reps=reps)
    made = wrapper.allreduce_calls if wrapper is not None else naive_calls[0]
    return {"median_s": t.median, "iqr_s": t.iqr, "calls_per_step": made // steps[0]}


def expected_num_buckets(model: nn.Module, bucket_bytes: int) -> int:
    """How many buckets the closing rule gives (reverse order, close at >= bucket_bytes)."""
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad][::-1]
    count, filled = 0, 0
    for nbytes in sizes:
        filled += nbytes
        if filled >= bucket_bytes:
            count, filled = count + 1, 0
    return count + (filled > 0)


def check_parity(states: list[dict], reference: dict, name: str = "") -> None:
    """Every rank's weights equal the single-process ones (and hence each other's)."""
    for rank, state in enumerate(states):
        for key, expected in reference.items():
            checks.assert_close(state[key], expected, name=f"{name} rank {rank} {key}".strip())


def check() -> None:
    """Naive and bucketed DDP on 2 ranks match single-process SGD; one all-reduce per bucket."""
    data = make_regression(0, 64, 12, 3)

    def model_fn():
        return small_mlp(1, 12, 24, 3)

    reference = train_reference(model_fn, data, steps=4, lr=0.1)
    check_parity(run_world(train_ddp, 2, model_fn, data, 4, 0.1), reference, "naive")
    for bucket_bytes in (1, 1024, 1 << 20):
        states = run_world(train_ddp, 2, model_fn, data, 4, 0.1, sync=BucketedDDP, bucket_bytes=bucket_bytes)
        check_parity(states, reference, f"bucketed {bucket_bytes} B")
        stats = run_world(bucket_stats, 2, model_fn, data, bucket_bytes, steps=2)[0]
        expected = expected_num_buckets(model_fn(), bucket_bytes)
        assert stats["num_buckets"] == expected and stats["allreduce_calls"] == 2 * expected, (stats, expected)
    print("ddp: naive and bucketed data parallel match single-process SGD")


if __name__ == "__main__":
    check()
