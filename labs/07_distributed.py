# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 07 — Distributed training: data parallel and beyond
#
# One device is rarely enough: a large model takes weeks on one GPU, or does not fit in its memory
# at all. This lab builds the core algorithms of distributed training from point-to-point messages
# and collectives, runs them for real on several processes of this machine, and checks every one
# against a single-process reference. You will:
#
# 1. start a *world* of processes and use collectives *(section 1, about 20 minutes)*;
# 2. turn single-process SGD into **data-parallel** SGD, then write a wrapper that behaves like
#    PyTorch's `DistributedDataParallel`: it broadcasts rank 0's state, and all-reduces each
#    gradient while backward is still running *(section 2, about 60 minutes; graded:
#    `ddp_parity`, 3 points)*;
# 3. make it cheaper with **gradient buckets** whose all-reduces overlap the backward pass, and
#    see the overlap on a timeline *(section 3, about 50 minutes; graded: `bucketed_ddp`,
#    3 points)*;
# 4. build the **ring all-reduce** from sends and receives, and see why it is bandwidth-optimal
#    *(section 4, about 45 minutes; graded: `ring_allreduce`, 3 points)*;
# 5. run a **parameter server** with asynchronous SGD, and bound the staleness of its gradients
#    *(section 5, about 50 minutes; graded: `parameter_server`, 1 point)*;
# 6. in the second session, shard any optimizer's state across ranks with **ZeRO-1**, bit for bit
#    equal to the unsharded optimizer *(section 6, about 45 minutes; graded: `zero1`, 2 points)*;
# 7. compare what the gloo, MPI and NCCL backends offer, and see what a larger global batch buys
#    *(section 7, about 25 minutes)*;
# 8. shard the weights themselves with **FSDP** (ZeRO-3), in fp32 and in bf16 with fp32 masters
#    *(section 8, about 80 minutes; graded: `fsdp`, 3 points; `fsdp_mixed`, 2 points)*;
# 9. split an MLP's matrices over the ranks: **tensor parallelism** *(section 9, about
#    40 minutes; graded: `tp_mlp`, 3 points)*;
# 10. survey pipeline and sequence parallelism *(section 10, about 15 minutes)*.
#
# Everything runs on the CPU with the gloo backend: each *rank* is a separate process, and
# collectives travel over local TCP sockets. The same functions run on NCCL with a GPU per rank,
# and across machines, under `torchrun` (see the README, "Scaling past one machine"). On two CPU cores the
# interesting figures are the *mechanism* ones — bytes sent, calls made, staleness observed,
# state held — which are the same on any hardware; wall times say more about this machine than
# about the algorithms.
#
# **How this lab is graded.** The grader takes only your functions and classes out of their cells
# and runs each on its own, with `torch`, `dist` (`torch.distributed`) and `nn` as the only names
# available besides what it passes in (and `fsdp`, the package's unit helpers, for FSDP): no
# imports inside them, no `getattr`/`eval`, no `_private` attributes of other objects, no
# assignments to attributes of anything but `self` and `ctx` (a gradient, `p.grad = ...`, is fine).
# Anything else those cells do at their top level does not reach the grader.
#
# The grader starts every rank of a world in a sandbox of its own, sends each rank only its own
# part of the hidden data (its slice of the batch, its own starting weights, its own tensor), and
# carries every collective and message itself: your ranks meet only through the grader's relay
# (no files, shared memory or sockets of their own in common), which logs what each rank sent.
# The values your ranks end with are compared with the grader's references; the traffic (a
# ring's bytes and chunks, each step's all-reduces, ZeRO's broadcasts, FSDP's gathers, tensor
# parallelism's all-reduces) is read from the relay's log; ZeRO-1's and FSDP's memory from each
# rank's memory peak on a larger model, against the course's implementation on the same world.
# What only your rank could count (that all-reduces started during backward, the optimizer state
# or tensors it holds) is worth one point of an item at most. The tests in this notebook measure
# the same things inside the ranks, for quick feedback; they are not the grade.
#
# **Time:** about 7.25 hours for a student who has done the labs before it, by section in minutes:
# §1 20; §2 60; §3 50; §4 45; §5 50; §6 45; §7 25; §8 80; §9 40; §10 15. It is the longest lab,
# about 1.75 times the median lab's hours, so it is taught over **two sessions**: sections 1–5
# (data parallelism, the ring, parameter servers), then sections 6–10 (sharding: ZeRO-1, FSDP,
# tensor parallelism). It stays one notebook, so that its graded items and the gradebook stay one
# lab. Graded code regions take most of it; the estimates are the course's, not measured on a
# class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import functools

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from fastdl_lab import distributed
from fastdl_lab.distributed import RankFailure, ddp, ps, ring, run_world, tensor_parallel, watch, zero

# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. A world of processes
#
# `torch.distributed` connects `world_size` processes, each identified by its **rank**
# `0 … world_size−1`, into a *process group*. Once every rank has joined (the *rendezvous*, through
# a small key-value store served by rank 0), they can exchange tensors in two ways:
#
# - **point-to-point**: `dist.send(t, dst)` / `dist.recv(t, src)`, and the non-blocking
#   `dist.isend` / `dist.irecv`, which return a request to `.wait()` on;
# - **collectives**, which every rank must call, in the same order: `all_reduce` (every rank ends
#   with the sum of everyone's tensor), `broadcast` (everyone gets rank 0's), `all_gather`
#   (everyone gets the list of everyone's), `reduce_scatter` (rank *r* gets the sum of everyone's
#   *r*-th piece), `barrier`.
#
# The *backend* moves the bytes: **NCCL** between GPUs (NVLink, InfiniBand), **gloo** between CPUs
# over TCP. `distributed.run_world(fn, world_size, *args)` forks `world_size` copies of this
# notebook's process, joins them in a gloo group, calls `fn(rank, world_size, *args)` in each and
# returns the list of their results. Because the ranks are forked copies, `fn` can be any function
# defined in a cell. What a rank prints appears below the cell, tagged with its rank.

# %%
def hello(rank, world_size):
    mine = torch.tensor([float(rank + 1)])
    total = mine.clone()
    dist.all_reduce(total)  # sum over ranks, in place, on every rank
    from_zero = torch.tensor([42.0]) if rank == 0 else torch.zeros(1)
    dist.broadcast(from_zero, src=0)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, mine * 10)
    print(f"I am rank {rank} of {world_size}, backend {dist.get_backend()}")
    return {"all_reduce": total.item(), "broadcast": from_zero.item(), "all_gather": [g.item() for g in gathered]}


for rank, result in enumerate(run_world(hello, 3)):
    print(rank, result)

# %% [markdown]
# A distributed program fails in distributed ways: one rank raises while the others wait forever
# in a collective that rank will never join. `run_world` gives every collective a timeout
# (`timeout_s`, 20 s by default), stops every rank as soon as one fails, and raises `RankFailure`
# naming the rank and the reason (its exception, the signal that killed it, or its silence). Keep
# that in mind when your own code misbehaves below: the failing rank and its traceback are in the
# error.

# %%
def rank_one_has_a_bug(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 divided by zero, figuratively")
    dist.barrier()  # rank 0 waits here for a partner who is gone


try:
    run_world(rank_one_has_a_bug, 2)
except RankFailure as failure:
    print(f"RankFailure: rank {failure.rank}: {failure.reason}")

# %% [markdown]
# ## 2. From one process to data parallel
#
# The model for this lab is a small MLP (`ddp.small_mlp`) fitted to a nonlinear regression
# problem (`ddp.make_regression`) with plain SGD on the mean squared error. `ddp.train_reference`
# trains it in one process on the whole batch: that is the answer every distributed version must
# reproduce.
#
# **Data parallelism** gives every rank a full copy of the model and $1/N$ of the batch. Each
# rank computes the gradient of the mean loss over its own slice. For equal slices of $B/N$
# examples, the full-batch gradient is the average of the slices' gradients:
#
# $$\nabla \frac{1}{B}\sum_{i=1}^{B} \ell_i = \frac{1}{N}\sum_{r=1}^{N} \nabla \frac{N}{B}\sum_{i \in \text{slice } r} \ell_i .$$
#
# So after backward, one **all-reduce** (sum) of each gradient followed by a division by $N$ gives
# every rank the full-batch gradient; every rank then takes the same SGD step, and the copies stay
# identical. Two details make it exact: the slices must be the same size (otherwise the average
# must be weighted), and every rank must **start from the same weights**, which is step 1 of the
# algorithm: rank 0's parameters *and buffers* (BatchNorm's running statistics, a fixed input
# shift) are broadcast to every rank before training.

# %%
data = ddp.make_regression(0, 64, 12, 3)


def model_fn():
    return ddp.small_mlp(1, 12, 32, 3)


x_all, y_all = data
losses = []
step_counts = range(0, 11, 5) if QUICK else range(0, 41, 5)
for steps in step_counts:
    trained = model_fn()
    trained.load_state_dict(ddp.train_reference(model_fn, data, steps, 0.2))
    losses.append(torch.nn.functional.mse_loss(trained(x_all), y_all).item())
fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(step_counts, losses, "o-")
ax.set_xlabel("SGD steps (full batch, one process)")
ax.set_ylabel("mean squared error")
plt.show()

# %% [markdown]
# Why the broadcast is not optional: processes that build "the same" model rarely hold the same
# numbers. Each seeds its own generator (or none), loads its own checkpoint, or draws in a
# different order. `ddp.rank_skewed_mlp` plays such a process: it puts `small_mlp` behind an
# `ddp.InputShift` (a buffer subtracted from the input) and draws both from a seed that differs
# on every rank; rank 0 draws what `rank=0` draws in a single process. Averaged gradients keep
# the replicas' *steps* equal, so replicas that start apart stay apart for ever.

# %%
def first_weights(rank, world_size):
    model = ddp.rank_skewed_mlp(1, 12, 32, 3)
    held = {}
    for when in ("as each rank built it", "after broadcast_state"):
        if when.startswith("after"):
            ddp.broadcast_state(model)
        held[when] = {"weight[0, :3]": model[1].weight[0, :3].tolist(), "shift[:3]": model[0].shift[:3].tolist()}
    return held


per_rank = run_world(first_weights, 2)
for when in per_rank[0]:
    print(f"{when}:")
    for rank, held in enumerate(per_rank):
        print(f"  rank {rank}: " + ", ".join(f"{k} = {[round(v, 3) for v in vals]}" for k, vals in held[when].items()))

# %% [markdown]
# The simplest synchronisation all-reduces each gradient once backward is over. `ddp.train_ddp`
# takes it as a function; since a function cannot broadcast when the model is built, `train_ddp`
# does that step for it:

# %%
def allreduce_gradients(model, world_size):
    """Average every parameter's gradient over the ranks, in place, after backward."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size


skewed_model = functools.partial(ddp.rank_skewed_mlp, 1, 12, 32, 3)
rank0_model = functools.partial(ddp.rank_skewed_mlp, 1, 12, 32, 3, rank=0)
states = run_world(ddp.train_ddp, 2, skewed_model, data, 5, 0.2, sync=allreduce_gradients)
ddp.check_parity(states, ddp.train_reference(rank0_model, data, 5, 0.2), name="naive:")
print("2 ranks that started apart now hold the single-process weights")

# %% [markdown]
# ### Your DDP wrapper
#
# PyTorch's `DistributedDataParallel` (Li et al., *PyTorch Distributed*, VLDB 2020) is a module
# that wraps yours: `DistributedDataParallel(model)`, then train the wrapper as if it were the
# model. It does two things the function above does not:
#
# - **it broadcasts rank 0's parameters and buffers when it is built**, so code that wraps a
#   model never trains replicas that started apart;
# - **it overlaps communication with backward.** Backward produces gradients from the last layer
#   to the first; the last layer's gradient is final long before backward ends. A **hook** on
#   each parameter (`p.register_post_accumulate_grad_hook(fn)`, called with the parameter once
#   its `.grad` has been accumulated) starts that gradient's all-reduce at once, with
#   `dist.all_reduce(grad, async_op=True)`, which returns a handle instead of waiting. The network
#   carries the last layers' gradients while the first layers' are still being computed.
#
# Torch's version finishes the synchronisation by itself at the end of backward; yours exposes it
# as a call. Complete `DDP(module)`, an `nn.Module`:
#
# - `__init__`: keep the model as `self.module` (already done: that is what makes
#   `parameters()`, `named_parameters()` and `state_dict()` torch DDP's, with names prefixed
#   `module.`); broadcast every parameter and every buffer from rank 0 (`dist.broadcast(t, src=0)`,
#   in place, under `torch.no_grad()`); register `_grad_ready` on every parameter that requires a
#   gradient;
# - `_grad_ready(param)`: start the asynchronous all-reduce of `param.grad` and keep its handle;
# - `finish_gradient_synchronization()`: wait for every handle, divide each gradient by the world
#   size, and forget the handles (the next step starts afresh).
#
# `ddp.train_ddp(..., sync=DDP)` builds your wrapper once per rank, around a model that rank built
# itself, trains `wrapper.parameters()` through `wrapper(x)` and calls
# `finish_gradient_synchronization()` after every backward pass. The test runs it through
# `watch.ddp_trial`, the same loop seen from outside your class: the state each rank started
# from, and every all-reduce the process group was asked for, with whether it began inside
# backward.

# %% nbgrader={"grade_id": "ddp_code", "solution": true}
import torch
import torch.distributed as dist
from torch import nn


class DDP(nn.Module):
    """Data parallelism as DistributedDataParallel does it: rank 0's state for everyone, then one
    asynchronous all-reduce per gradient, started the moment backward produces it."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.world_size = dist.get_world_size()
        ### BEGIN SOLUTION
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self.handles = []
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._grad_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, param):
        """Autograd calls this as soon as param.grad has been accumulated."""
        ### BEGIN SOLUTION
        self.handles.append((param, dist.all_reduce(param.grad, async_op=True)))
        ### END SOLUTION

    def finish_gradient_synchronization(self):
        """Wait for this step's all-reduces and leave the averaged gradients in every p.grad."""
        ### BEGIN SOLUTION
        for param, handle in self.handles:
            handle.wait()
            param.grad /= self.world_size
        self.handles = []
        ### END SOLUTION


# %% nbgrader={"grade_id": "ddp_parity", "grade": true, "points": 3}
import functools

from fastdl_lab.distributed import ddp, run_world, watch

# Every rank draws different weights and a different buffer; rank 0's are the reference's.
_model = functools.partial(ddp.rank_skewed_mlp, 5, 10, 16, 2)
_model0 = functools.partial(ddp.rank_skewed_mlp, 5, 10, 16, 2, rank=0)
_data = ddp.make_regression(5, 24, 10, 2)
_reference = ddp.train_reference(_model0, _data, 4, 0.2)
_sizes = [_p.numel() for _p in _model0().parameters()]
for _world in (2, 3):
    _trials = run_world(watch.ddp_trial, _world, _model, _data, 4, 0.2, sync=DDP)
    watch.check_trials(_trials, _model0, _reference, name=f"{_world} ranks:")
    _problem = watch.overlap_problem(_trials, _sizes, 4, ordered=False)
    assert _problem is None, f"{_world} ranks: {_problem[1]}"
print("ddp_parity: visible tests passed")
### BEGIN HIDDEN TESTS
_hidden_model = functools.partial(ddp.rank_skewed_mlp, 9, 7, 13, 3)
_hidden_model0 = functools.partial(ddp.rank_skewed_mlp, 9, 7, 13, 3, rank=0)
_hidden_data = ddp.make_regression(9, 36, 7, 3)
_hidden_reference = ddp.train_reference(_hidden_model0, _hidden_data, 6, 0.15)
for _hidden_world in (2, 4):
    _hidden_trials = run_world(watch.ddp_trial, _hidden_world, _hidden_model, _hidden_data, 6, 0.15, sync=DDP)
    watch.check_trials(_hidden_trials, _hidden_model0, _hidden_reference, name=f"hidden, {_hidden_world} ranks:")
    assert watch.overlap_problem(_hidden_trials, [_p.numel() for _p in _hidden_model0().parameters()], 6,
                                 ordered=False) is None
### END HIDDEN TESTS

# %% [markdown]
# ## 3. Why buckets
#
# Your wrapper overlaps, and still pays for one call per tensor.
#
# **Latency per call.** A collective costs roughly $\alpha + n/\beta$ for $n$ bytes: a fixed
# latency $\alpha$ (synchronising the ranks, the network's round trips, launching the operation)
# plus the bytes over the bandwidth. One call per parameter pays $\alpha$ once per tensor — a
# transformer has hundreds of them, biases and norms of a few kilobytes among them. Measured on
# this machine with gloo:

# %%
def allreduce_times(rank, world_size, sizes):
    medians = []
    for numel in sizes:
        buffer = torch.ones(numel)
        medians.append(distributed.bench_in_rank(lambda: dist.all_reduce(buffer), reps=3 if QUICK else 10).median)
    return medians


sizes = [1, 4096, 65536] if QUICK else [1, 256, 4096, 65536, 1 << 20]
seconds = run_world(allreduce_times, 2, sizes)[0]
nbytes = torch.tensor([4.0 * n for n in sizes], dtype=torch.float64)
# Least squares for t = alpha + bytes / beta.
design = torch.stack([torch.ones_like(nbytes), nbytes], 1)
alpha, inv_beta = torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64).unsqueeze(1)).solution[:, 0]
for n, t in zip(sizes, seconds):
    print(f"{4 * n:>9} B: {t * 1e6:9.1f} µs")
print(f"fit: alpha ≈ {alpha.item() * 1e6:.0f} µs, beta ≈ {1 / inv_beta.item() / 1e9:.2f} GB/s "
      f"(so a message below ~{alpha.item() / inv_beta.item() / 1e3:.0f} kB costs mostly latency)")
fig, ax = plt.subplots(figsize=(5, 3))
ax.loglog(nbytes, seconds, "o-")
ax.set_xlabel("bytes all-reduced (2 ranks, gloo)")
ax.set_ylabel("seconds")
plt.show()

# %% [markdown]
# Torch's DDP therefore packs gradients into **buckets** of about `bucket_bytes` (25 MB by
# default), filled in **reverse** parameter order — the order backward produces them — so there
# are few calls, each large enough to amortise $\alpha$. When the last gradient of a bucket
# arrives, the bucket is flattened into one buffer and its all-reduce is launched asynchronously,
# so communication still overlaps the rest of backward.
#
# One rule is easy to miss: collectives are matched by the order in which ranks issue them, not
# by name. If two ranks launched buckets in different orders, rank 0's bucket 1 would be summed
# with rank 1's bucket 0. Launch buckets strictly in bucket order: when a bucket completes before
# an earlier one, it waits for it.
#
# ### Your bucketed DDP
#
# Complete `BucketedDDP(module, bucket_bytes)`, a wrapper like your `DDP`:
#
# - `__init__`: broadcast rank 0's parameters and buffers, as in `DDP`. Walk the parameters that
#   require gradients in **reverse** order, appending each to the current bucket; close the bucket
#   as soon as it holds **at least** `bucket_bytes` (`p.numel() * p.element_size()` each), and
#   start a new one; the last bucket may be smaller. So `bucket_bytes=1` gives one bucket per
#   parameter, and a huge value a single bucket. Then register `_grad_ready` on every such
#   parameter;
# - `num_buckets`: how many buckets there are;
# - `_grad_ready(param)`: count the arrival; launch every bucket that is now complete, in order;
# - `_launch(index)`: flatten the bucket's gradients (`torch.cat` of `g.reshape(-1)`), start
#   `dist.all_reduce(flat, async_op=True)`, keep the buffer and the handle;
# - `finish_gradient_synchronization()`: launch any bucket not launched yet (a parameter without
#   a gradient counts as zeros), wait for every handle, divide by the world size, copy each slice
#   back into its parameter's `.grad`, and reset for the next step.
#
# `ddp.train_ddp(..., sync=BucketedDDP, bucket_bytes=...)` builds your wrapper with
# `BucketedDDP(model, bucket_bytes=...)`.

# %% nbgrader={"grade_id": "bucketed_code", "solution": true}
import torch
import torch.distributed as dist
from torch import nn


class BucketedDDP(nn.Module):
    """Rank 0's state for everyone, then gradients averaged in buckets whose all-reduces overlap backward."""

    def __init__(self, module, bucket_bytes=25 << 20):
        super().__init__()
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.world_size = dist.get_world_size()
        ### BEGIN SOLUTION
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor, src=0)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = []
        bucket, filled = [], 0
        for p in params[::-1]:
            bucket.append(p)
            filled += p.numel() * p.element_size()
            if filled >= bucket_bytes:
                self.buckets.append(bucket)
                bucket, filled = [], 0
        if bucket:
            self.buckets.append(bucket)
        self.where = {p: index for index, members in enumerate(self.buckets) for p in members}
        self.arrived = [0] * len(self.buckets)
        self.next_bucket = 0
        self.pending = []
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def num_buckets(self):
        ### BEGIN SOLUTION
        return len(self.buckets)
        ### END SOLUTION

    def _grad_ready(self, param):
        """Autograd calls this as soon as param.grad has been accumulated."""
        ### BEGIN SOLUTION
        self.arrived[self.where[param]] += 1
        while (self.next_bucket < len(self.buckets)
               and self.arrived[self.next_bucket] == len(self.buckets[self.next_bucket])):
            self._launch(self.next_bucket)
        ### END SOLUTION

    def _launch(self, index):
        """Start the asynchronous all-reduce of bucket ``index``."""
        ### BEGIN SOLUTION
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[index]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        handle = dist.all_reduce(flat, async_op=True)
        self.pending.append((index, flat, handle))
        self.next_bucket = index + 1
        ### END SOLUTION

    def finish_gradient_synchronization(self):
        """Wait for every bucket and leave the averaged gradients in every p.grad."""
        ### BEGIN SOLUTION
        while self.next_bucket < len(self.buckets):
            self._launch(self.next_bucket)
        for index, flat, handle in self.pending:
            handle.wait()
            flat /= self.world_size
            start = 0
            for p in self.buckets[index]:
                averaged = flat[start:start + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = averaged.clone()
                else:
                    p.grad.copy_(averaged)
                start += p.numel()
        self.arrived = [0] * len(self.buckets)
        self.next_bucket = 0
        self.pending = []
        ### END SOLUTION


# %% nbgrader={"grade_id": "bucketed_ddp", "grade": true, "points": 3}
import functools

from fastdl_lab.distributed import ddp, run_world, watch

_model = functools.partial(ddp.rank_skewed_mlp, 6, 10, 16, 2)
_model0 = functools.partial(ddp.rank_skewed_mlp, 6, 10, 16, 2, rank=0)
_data = ddp.make_regression(6, 32, 10, 2)
_reference = ddp.train_reference(_model0, _data, 4, 0.2)
# Reversed, the parameters hold 8, 128, 64, 1024, 64 and 640 bytes: 700 makes two buckets.
for _bucket_bytes in (1, 700, 1 << 30):
    _trials = run_world(watch.ddp_trial, 2, _model, _data, 4, 0.2, sync=BucketedDDP, bucket_bytes=_bucket_bytes)
    watch.check_trials(_trials, _model0, _reference, name=f"bucket_bytes={_bucket_bytes}:")
    # One all-reduce per bucket per step, of the bucket's size, in bucket order, during backward.
    _problem = watch.overlap_problem(_trials, ddp.bucket_sizes(_model0(), _bucket_bytes), 4, ordered=True)
    assert _problem is None, f"bucket_bytes={_bucket_bytes}: {_problem[1]}"
print("bucketed_ddp: visible tests passed")
### BEGIN HIDDEN TESTS
_hidden_model = functools.partial(ddp.rank_skewed_mlp, 12, 9, 20, 4)
_hidden_model0 = functools.partial(ddp.rank_skewed_mlp, 12, 9, 20, 4, rank=0)
_hidden_data = ddp.make_regression(12, 30, 9, 4)
_hidden_reference = ddp.train_reference(_hidden_model0, _hidden_data, 5, 0.1)
for _hidden_world, _hidden_bytes in ((3, 400), (2, 2000), (3, 80)):
    _hidden_trials = run_world(watch.ddp_trial, _hidden_world, _hidden_model, _hidden_data, 5, 0.1,
                               sync=BucketedDDP, bucket_bytes=_hidden_bytes)
    watch.check_trials(_hidden_trials, _hidden_model0, _hidden_reference,
                       name=f"hidden, {_hidden_world} ranks, bucket_bytes={_hidden_bytes}:")
    assert watch.overlap_problem(_hidden_trials, ddp.bucket_sizes(_hidden_model0(), _hidden_bytes), 5,
                                 ordered=True) is None
### END HIDDEN TESTS

# %% [markdown]
# What overlap looks like: one training step of a wider MLP on 2 ranks with each strategy, as
# `watch.ddp_trial` saw it on rank 0. Each bar is one all-reduce, from its launch to its
# completion; the grey band is backward, and the dashed line is where the optimizer step begins
# (everything before it is on the step's critical path). The naive function starts every
# all-reduce after backward; the wrappers start theirs inside it, the per-parameter one many small
# ones, the bucketed one a few large ones. Each rank here is one thread on one core, so the gloo
# transfers compete with backward for the same two cores; on GPUs the device computes while the
# network transfers, and the overlap is nearly free.

# %%
width = 64 if QUICK else 256
timeline_data = ddp.make_regression(0, 4 * width, width, width)


def timeline_model():
    return ddp.small_mlp(0, width, 2 * width, width)


strategies = [("naive, after backward", allreduce_gradients, {}), ("DDP, one per parameter", DDP, {}),
              (f"BucketedDDP, {width * width // 256} KiB buckets", BucketedDDP, {"bucket_bytes": width * width * 4})]
fig, axes = plt.subplots(len(strategies), 1, figsize=(7, 4.5), sharex=True)
for ax, (label, sync, kwargs) in zip(axes, strategies):
    trial = run_world(watch.ddp_trial, 2, timeline_model, timeline_data, 2, 0.01, sync=sync, **kwargs)[0]
    # The second step: the first one pays one-off costs (allocations, the first collective).
    timeline = watch.timeline(trial, step=1)
    ax.axvspan(*timeline["backward"], color="0.85")
    for lane, (start, end, numel) in enumerate(timeline["allreduces"]):
        ax.barh(lane, end - start, left=start, height=0.7, color="tab:blue")
    ax.axvline(timeline["step"], color="black", linestyle="--", linewidth=1)
    ax.set_yticks([])
    ax.invert_yaxis()  # the first all-reduce on top
    ax.set_ylabel(f"{len(timeline['allreduces'])} calls", fontsize=8)
    ax.set_title(label, fontsize=9, loc="left")
axes[-1].set_xlabel("milliseconds since backward began (rank 0)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. The ring all-reduce
#
# How should $N$ ranks sum a tensor of $S$ bytes? The obvious way — everyone sends to rank 0,
# which adds and sends the total back — makes rank 0 receive and send $(N-1)\,S$ bytes: its link
# is the bottleneck, and the time grows with $N$.
#
# The **ring** arranges the ranks in a circle, each sending only to its right neighbour. The
# tensor is cut into $N$ chunks, and the algorithm has two phases of $N-1$ steps each:
#
# 1. **reduce-scatter**: at step $s$, rank $r$ sends chunk $(r - s) \bmod N$ to the right and
#    receives chunk $(r - s - 1) \bmod N$ from the left, which it adds into its own copy. A chunk
#    travels around the ring collecting one contribution per hop; after $N-1$ steps rank $r$ holds
#    the complete sum of chunk $(r + 1) \bmod N$;
# 2. **all-gather**: at step $s$, rank $r$ sends chunk $(r + 1 - s) \bmod N$ — complete by now —
#    and overwrites chunk $(r - s) \bmod N$ with the one that arrives. After $N-1$ more steps
#    everyone has every complete chunk.
#
# Each rank sends $2(N-1)$ chunks of $S/N$ bytes: $2\frac{N-1}{N}S$, which stays below $2S$
# however many ranks there are, and every link is busy at every step. When the ranks do the
# adding, no all-reduce algorithm can make a rank send less (Patarasuk and Yuan, 2009, prove the
# bound). Switches that add in the network (NVLink SHARP in NVSwitch, SHARP in InfiniBand) change
# the rules: each rank sends its $S$ bytes once and receives the sum. That is why NCCL uses rings
# for large tensors (and trees where latency dominates), and why a collective's "bus bandwidth" is
# quoted as $2\frac{N-1}{N}S / t$.
#
# Two practical points:
#
# - **Deadlock.** If every rank called a blocking `send` first, each would wait for its neighbour
#   to receive, around the whole ring. Post the send with `dist.isend` (and the receive with
#   `dist.irecv`), then `.wait()` on both.
# - **Uneven sizes.** `numel` need not be a multiple of $N$, and can be smaller than $N$. Split
#   as `torch.tensor_split(flat, N)` does: with `numel = q·N + m`, the first `m` chunks get `q + 1`
#   elements and the rest `q` (some may be empty — skip sending and receiving those, on both
#   sides alike). A version that cuts `numel // N`-element chunks silently never reduces the last
#   `numel % N` elements.
#
# ### Your ring
#
# Write `ring_allreduce(tensor) -> int`: sum a contiguous tensor over all ranks **in place**,
# using only `isend` / `irecv`, and return the number of bytes this rank sent. With chunk sizes
# $c_i$, rank $r$ sends every chunk but $c_{(r+1) \bmod N}$ in the first phase and every chunk but
# $c_{(r+2) \bmod N}$ in the second: `ring.ring_bytes_ref(numel, element_size, N, r)` is that
# count, and the test compares yours to it.

# %% nbgrader={"grade_id": "ring_code", "solution": true}
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    """Sum ``tensor`` (contiguous) over all ranks in place with isend/irecv; return bytes sent."""
    ### BEGIN SOLUTION
    rank = dist.get_rank()
    world = dist.get_world_size()
    pieces = list(torch.tensor_split(tensor.view(-1), world))
    right = (rank + 1) % world
    left = (rank - 1) % world
    sent = 0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            if phase == "reduce-scatter":
                out_index, in_index = (rank - step) % world, (rank - step - 1) % world
            else:
                out_index, in_index = (rank + 1 - step) % world, (rank - step) % world
            outgoing = pieces[out_index]
            incoming = torch.empty_like(pieces[in_index])
            requests = []
            if outgoing.numel() > 0:
                requests.append(dist.isend(outgoing, dst=right))
                sent += outgoing.numel() * outgoing.element_size()
            if incoming.numel() > 0:
                requests.append(dist.irecv(incoming, src=left))
            for request in requests:
                request.wait()
            if phase == "reduce-scatter":
                pieces[in_index] += incoming
            else:
                pieces[in_index].copy_(incoming)
    return sent
    ### END SOLUTION


# %% nbgrader={"grade_id": "ring_allreduce", "grade": true, "points": 3}
from fastdl_lab.distributed import ring, run_world


def _trials(rank, world_size, sizes, seed):
    return [ring.ring_trial(rank, world_size, n, allreduce=ring_allreduce, seed=seed) for n in sizes]


_sizes = (1, 5, 7, 1000)
for _world in (2, 3, 4):
    _per_rank = run_world(_trials, _world, _sizes, 0)
    for _i, _numel in enumerate(_sizes):
        ring.check_ring([_r[_i] for _r in _per_rank], _numel, seed=0, name="ring_allreduce")
print("ring_allreduce: visible tests passed")
### BEGIN HIDDEN TESTS
for _hidden_world, _hidden_sizes in ((3, (2, 3, 4, 301)), (4, (3, 6, 999)), (2, (2, 1023))):
    _hidden_results = run_world(_trials, _hidden_world, _hidden_sizes, 7)
    for _j, _hidden_numel in enumerate(_hidden_sizes):
        ring.check_ring([_h[_j] for _h in _hidden_results], _hidden_numel, seed=7, name="hidden ring")
### END HIDDEN TESTS

# %% [markdown]
# What your ring sent on this machine, against the formula, and the bytes on the busiest link
# for a 100 MB gradient, against the root-based scheme:

# %%
numel = 1 << 18
for world_size in (2, 3, 4):
    sent = [r["sent"] for r in run_world(ring.ring_trial, world_size, numel, allreduce=ring_allreduce)]
    print(f"{world_size} ranks: each sent {sent[0] / 2**20:.3f} MiB of a {4 * numel / 2**20:.0f} MiB tensor "
          f"(2(N-1)/N = {ring.busbw_factor(world_size):.3f})")

worlds = list(range(2, 65))
gradient = 25_000_000  # float32 elements: 100 MB
fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(10, 3.4))
ax_bytes.plot(worlds, [ring.ring_bytes_ref(gradient, 4, n, 0) / 1e6 for n in worlds], label="ring: every rank")
ax_bytes.plot(worlds, [ring.root_allreduce_bytes(gradient, 4, n) / 1e6 for n in worlds], label="via rank 0: rank 0")
ax_bytes.set_xlabel("ranks N")
ax_bytes.set_ylabel("MB through the busiest link")
ax_bytes.set_yscale("log")
ax_bytes.legend(fontsize=8)
# The alpha-beta model with a datacentre network's figures: 5 µs a message, 25 GB/s a link.
for nbytes, size, style in ((4096, "4 kB", "--"), (1e8, "100 MB", "-")):
    for algorithm in ("ring", "tree"):
        ax_time.plot(worlds, [ring.allreduce_time_model(nbytes, n, 5e-6, 25e9, algorithm) for n in worlds], style,
                     label=f"{algorithm}, {size}")
ax_time.set_xlabel("ranks N")
ax_time.set_ylabel("modelled seconds")
ax_time.set_yscale("log")
ax_time.legend(fontsize=7)
plt.show()

# %% [markdown]
# The right-hand plot is the $\alpha$-$\beta$ model of `ring.allreduce_time_model`: the ring's
# bandwidth term stays flat, but it takes $2(N-1)$ steps, each paying the latency $\alpha$. A
# binomial tree takes only $2\lceil\log_2 N\rceil$ steps but moves the whole tensor in each. For
# 100 MB the ring wins at any size; for 4 kB the latency dominates and the tree wins as $N$ grows.
# NCCL chooses between them by message size and topology.

# %% [markdown]
# ## 5. Parameter servers and asynchronous SGD
#
# Before all-reduce took over, data parallelism ran on a **parameter server** (DistBelief's
# Downpour SGD, Dean et al. 2012; Li et al., OSDI 2014): a server owns the weights, workers
# *pull* them, compute a gradient on their data and *push* it back. `ps.run_ps` implements one on
# a linear regression, with rank 0 as the server and ranks 1… as workers, all with `send`/`recv`
# (the server receives from whichever worker speaks first). The server counts **versions**: one
# per update it applies.
#
# - **Synchronous**: the server waits for a gradient from every worker, averages them and applies
#   the average. Exactly full-batch gradient descent — and every step runs at the pace of the
#   slowest worker.
# - **Asynchronous**: the server applies every gradient as soon as it arrives. Nobody waits, but a
#   slow worker's gradient was computed on weights several versions old. Its **staleness** is the
#   server's version minus the version it was computed on; stale gradients point where the loss
#   *used* to go down, and with a large learning rate they make training oscillate or diverge.
# - **A drop rule** (the `bounded` mode here): a gradient more than $\tau$ versions old is not
#   applied; its worker must pull the current weights and recompute. $\tau = 0$ admits only
#   gradients computed on the current weights; $\tau = \infty$ is asynchronous. Nobody waits,
#   and the work that went into a dropped gradient is lost.
#
# The literature's bound on staleness works the other way round. In **bounded delay** (Li et al.,
# OSDI 2014) a worker may not start a task until every task started $\tau$ steps earlier has
# finished; in **stale synchronous parallel**, SSP (Ho et al., NIPS 2013), a worker may run at most
# $\tau$ clock ticks ahead of the slowest. Either way the fast workers *wait*: every gradient
# computed is applied and none is thrown away, and $\tau = 0$ is synchronous SGD again. A drop
# rule caps the same age without making anyone wait, at the price of discarded work.
#
# ### Your admission rule
#
# Write `bounded_staleness_rule(server_version, gradient_version, tau) -> bool`: may the server,
# now at `server_version`, apply a gradient computed on the weights of `gradient_version`?
# Staleness exactly $\tau$ is allowed. `ps.run_ps(..., mode="bounded", rule=...)` calls it for
# every gradient pushed, and records the staleness of every gradient it applies.

# %% nbgrader={"grade_id": "ps_code", "solution": true}
def bounded_staleness_rule(server_version, gradient_version, tau):
    """True when a gradient computed on gradient_version may be applied at server_version."""
    ### BEGIN SOLUTION
    staleness = server_version - gradient_version
    return staleness <= tau
    ### END SOLUTION


# %% [markdown]
# Three workers, the third ten times slower than the first (artificial delays, so that the result
# does not depend on how the operating system schedules three processes on two cores):

# %%
delays = [0.002, 0.004, 0.03]
runs = {}
for label, mode, tau in [("sync", "sync", 0), ("async", "async", 0), ("bounded, tau=1", "bounded", 1),
                         ("bounded, tau=4", "bounded", 4)]:
    runs[label] = run_world(ps.run_ps, 4, mode, tau, 12 if QUICK else 60, 0.5, 0, worker_delays=delays,
                            rule=bounded_staleness_rule)[0]
print(f"{'':>15} {'seconds':>8} {'max stale':>9} {'rejected':>8} {'final loss':>10}  (optimum "
      f"{runs['sync']['optimal_loss']:.4f})")
for label, r in runs.items():
    print(f"{label:>15} {r['seconds']:8.2f} {max(r['staleness']):9d} {r['rejected']:8d} {r['loss']:10.4f}")
fig, ax = plt.subplots(figsize=(5.5, 3.2))
for label in ("async", "bounded, tau=4"):
    stale = runs[label]["staleness"]
    ax.hist(stale, bins=range(max(stale) + 2), alpha=0.6, label=label, align="left")
ax.set_xlabel("staleness of an applied gradient (versions)")
ax.set_ylabel("gradients")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Read the table: synchronous SGD is exact and takes as long as 60 of the slowest worker's steps;
# asynchronous SGD is many times faster in wall time but applies gradients many versions old,
# and at this learning rate its final loss suffers; the drop rule keeps the speed while capping
# the age, at the price of the slow worker's rejected (wasted) gradients. Bounded delay or SSP
# would apply those gradients and make the fast workers wait for the slow one instead. Note also
# who does the work: the fast workers make most updates, so their shards of the data weigh more
# — another bias asynchrony brings.

# %% nbgrader={"grade_id": "parameter_server", "grade": true, "points": 1}
from fastdl_lab.distributed import ps, run_world

assert bool(bounded_staleness_rule(5, 5, 0)) is True, "a gradient on the current weights is always admitted"
assert bool(bounded_staleness_rule(5, 4, 0)) is False, "tau=0 admits only current gradients"
assert bool(bounded_staleness_rule(9, 6, 3)) is True, "staleness exactly tau is admitted"
assert bool(bounded_staleness_rule(9, 5, 3)) is False, "staleness tau + 1 is rejected"
_server = run_world(ps.run_ps, 3, "bounded", 2, 60, 0.1, 1, worker_delays=[0.002, 0.01],
                    rule=bounded_staleness_rule)[0]
assert max(_server["staleness"]) <= 2, f"a gradient {max(_server['staleness'])} versions old was applied with tau=2"
assert ps.converged(_server), f"loss {_server['loss']:.4f} did not approach the optimum {_server['optimal_loss']:.4f}"
print("parameter_server: visible tests passed")
### BEGIN HIDDEN TESTS
assert bool(bounded_staleness_rule(100, 100, 7)) and not bool(bounded_staleness_rule(100, 92, 7))
assert bool(bounded_staleness_rule(3, 0, 3)) and not bool(bounded_staleness_rule(4, 0, 3))
for _hidden_tau in (0, 3):
    _hidden_server = run_world(ps.run_ps, 4, "bounded", _hidden_tau, 50, 0.2, 3,
                               worker_delays=[0.001, 0.003, 0.015], rule=bounded_staleness_rule)[0]
    assert max(_hidden_server["staleness"]) <= _hidden_tau, ("hidden staleness", _hidden_tau, _hidden_server["staleness"])
    assert ps.converged(_hidden_server), ("hidden convergence", _hidden_server["loss"])
### END HIDDEN TESTS

# %% [markdown]
# ### Waiting instead of discarding: stale synchronous parallel
#
# The table above shows what the drop rule costs: the slow worker's gradients are the ones
# rejected, so its shard of the data barely reaches the weights, and a worker slow enough would
# never contribute at all. SSP, as introduced at the start of this section, makes a worker that
# runs ahead **wait** instead, and discards nothing.
#
# Each worker has a **clock**: the number of its gradients the server has applied. A worker about
# to start iteration $c$ (its clock is $c$) may start only once every worker has finished the
# iterations before $c - \tau$, i.e. while it is at most $\tau$ iterations ahead of the slowest;
# otherwise the server holds its answer until the slowest catches up. $\tau = 0$ is
# bulk-synchronous: every worker waits for all the others each iteration, yet nobody waits for
# ever (the slowest worker may always start). A large $\tau$ is asynchronous. The bound is on
# iterations, not versions: every gradient is still applied on its own, so a gradient may be up to
# about $(\tau + 1) K$ versions old with $K$ workers, and each round of $K$ gradients moves the
# weights about $K$ times as far as a synchronous step (mind the learning rate).
#
# Write `ssp_may_start(clocks, worker, tau) -> bool`: `clocks[i]` is worker `i`'s clock, and the
# answer says whether `worker` (an index into `clocks`) may start its next iteration now.
# `ps.run_ps(..., mode="ssp", start_rule=...)` asks it each time a worker's gradient is applied,
# for that worker and for every worker it holds, and records each applied gradient's **clock
# gap**: how many iterations its worker was ahead of the slowest when it started computing it.

# %% nbgrader={"grade_id": "ssp_code", "solution": true}
def ssp_may_start(clocks, worker, tau):
    """True when `worker`, whose clock is clocks[worker], may start its next iteration."""
    ### BEGIN SOLUTION
    return clocks[worker] - min(clocks) <= tau
    ### END SOLUTION


# %% [markdown]
# The same three workers, the drop rule against SSP for the same $\tau$, at a learning rate all
# modes can take:

# %%
ssp_runs = {}
for label, mode, tau in [("async", "async", 0), ("drop, tau=1", "bounded", 1), ("ssp, tau=0", "ssp", 0),
                         ("ssp, tau=1", "ssp", 1)]:
    ssp_runs[label] = run_world(ps.run_ps, 4, mode, tau, 9 if QUICK else 60, 0.2, 0, worker_delays=delays,
                                rule=bounded_staleness_rule, start_rule=ssp_may_start)[0]
print(f"{'':>12} {'seconds':>8} {'max stale':>9} {'max gap':>7} {'rejected':>8} {'held':>5} {'final loss':>10}  "
      f"(optimum {ssp_runs['async']['optimal_loss']:.5f})")
for label, r in ssp_runs.items():
    print(f"{label:>12} {r['seconds']:8.2f} {max(r['staleness']):9d} {max(r['clock_gaps']):7d} {r['rejected']:8d} "
          f"{r['holds']:5d} {r['loss']:10.5f}")
print("updates made by each worker:", {label: [r["updates_by"].count(w) for w in (1, 2, 3)]
                                        for label, r in ssp_runs.items()})

# %% [markdown]
# Under the drop rule the fast workers make nearly every update and the slow one's rejected
# gradients are wasted work (in one run on a 2-core machine: 46, 14 and 0 updates); its data is
# under-represented, and the weights settle away from the least-squares optimum of the whole data
# set. Under SSP every worker makes a third of the updates,
# the clock gap never exceeds $\tau$, no gradient is rejected, and the final loss is the optimum's;
# the price is time, since everyone now moves at the slowest worker's pace (within $\tau$).
#
# ### A synchronous start, then asynchrony
#
# Stale gradients hurt most at the start, when the gradients are large and the weights move
# fastest: a gradient a few versions old then points somewhere quite different. A common recipe is
# to run the first epoch (here: the first few updates) synchronously and only then let workers go
# asynchronous. `sync_steps=` does that. At a learning rate where asynchrony from the first step
# diverges:

# %%
warm = {}
for sync_steps in (0, 5):
    # At the quick size the curves are too short to show the effect; they only check the code runs.
    warm[sync_steps] = run_world(ps.run_ps, 4, "async", 0, 10 if QUICK else 60, 0.7, 0, worker_delays=delays,
                                 sync_steps=sync_steps)[0]
fig, ax = plt.subplots(figsize=(5.5, 3.2))
for sync_steps, r in warm.items():
    ax.semilogy(range(1, len(r["losses"]) + 1), r["losses"],
                label="async from the start" if not sync_steps else f"{sync_steps} sync rounds, then async")
ax.axhline(warm[0]["optimal_loss"], color="grey", linestyle=":", label="optimum")
ax.set_xlabel("update")
ax.set_ylabel("loss")
ax.legend(fontsize=8)
plt.show()
for sync_steps, r in warm.items():
    print(f"sync_steps={sync_steps}: final loss {r['loss']:.4g}, converged: {ps.converged(r)}")

# %% [markdown]
# The timing decides how stale each gradient is, so the curves change from run to run. In ten runs
# on a 2-core machine, asynchrony from the first step ended far from the optimum of 0.0043 every
# time (a final loss between 0.78 and about 4000, from 2.25 at the start), and five synchronous
# rounds first converged every time.

# %% nbgrader={"grade_id": "ssp", "grade": true, "points": 1}
from fastdl_lab.distributed import ps, run_world

assert bool(ssp_may_start([0, 0, 0], 1, 0)) is True, "with every clock equal, any worker may start"
assert bool(ssp_may_start([1, 0, 0], 0, 0)) is False, "tau=0: wait until every worker has finished this iteration"
assert bool(ssp_may_start([3, 1], 0, 2)) is True, "exactly tau iterations ahead of the slowest may start"
assert bool(ssp_may_start([4, 1], 0, 2)) is False, "tau + 1 ahead must wait"
assert bool(ssp_may_start([4, 1], 1, 0)) is True, "the slowest worker may always start"
_ssp = run_world(ps.run_ps, 3, "ssp", 1, 40, 0.1, 1, worker_delays=[0.002, 0.02], start_rule=ssp_may_start)[0]
assert not _ssp["deadlocked"], "every worker was held at once: the rule lets nobody start"
assert max(_ssp["clock_gaps"]) <= 1, f"a worker started {max(_ssp['clock_gaps'])} iterations ahead with tau=1"
assert _ssp["rejected"] == 0 and ps.converged(_ssp), f"loss {_ssp['loss']:.4f}, optimum {_ssp['optimal_loss']:.4f}"
print("ssp: visible tests passed")
### BEGIN HIDDEN TESTS
assert bool(ssp_may_start([7, 5, 9, 6], 2, 4)) and not bool(ssp_may_start([7, 5, 10, 6], 2, 4))
assert bool(ssp_may_start([2, 2], 0, 0)) and not bool(ssp_may_start([3, 2], 0, 0))
for _hidden_tau in (0, 2):
    _hidden_ssp = run_world(ps.run_ps, 4, "ssp", _hidden_tau, 45, 0.1, 3, worker_delays=[0.001, 0.003, 0.015],
                            start_rule=ssp_may_start)[0]
    assert not _hidden_ssp["deadlocked"], ("hidden deadlock", _hidden_tau)
    assert max(_hidden_ssp["clock_gaps"]) <= _hidden_tau, ("hidden clock gap", _hidden_tau, _hidden_ssp["clock_gaps"])
    assert ps.converged(_hidden_ssp), ("hidden convergence", _hidden_ssp["loss"])
### END HIDDEN TESTS

# %% [markdown]
# ## 6. Sharding the optimizer state: ZeRO-1
#
# *The second session of this lab starts here.*
#
# Data parallelism replicates everything on every rank. How much is everything? Training with Adam
# in mixed precision keeps, per parameter (Rajbhandari et al., *ZeRO*, SC 2020):
#
# | what | bytes |
# |---|---|
# | fp16 weights | 2 |
# | fp16 gradients | 2 |
# | fp32 master weights, Adam's first and second moments | 4 + 4 + 4 = 12 |
#
# 16 bytes per parameter, three quarters of them optimizer state — 112 GB for a 7-billion-parameter
# model before a single activation, more than any one GPU holds. Yet a rank only needs the state
# of the parameters it updates. ZeRO removes the redundancy in stages:
#
# - **stage 1** shards the optimizer state: $2 + 2 + 12/N$ bytes per parameter;
# - **stage 2** also shards the gradients: $2 + (2 + 12)/N$;
# - **stage 3** also shards the weights, gathering each layer's just before use: $16/N$ (PyTorch's
#   FSDP).

# %%
def gigabytes_per_rank(params, ranks, stage):
    weights, grads, state = 2.0, 2.0, 12.0
    if stage >= 1:
        state /= ranks
    if stage >= 2:
        grads /= ranks
    if stage >= 3:
        weights /= ranks
    return params * (weights + grads + state) / 1e9


print(f"{'7.5e9 parameters':>18}" + "".join(f"{f'N={n}':>10}" for n in (1, 8, 64)))
for stage in range(4):
    print(f"{f'ZeRO stage {stage}':>18}" + "".join(f"{gigabytes_per_rank(7.5e9, n, stage):9.1f}G" for n in (1, 8, 64)))

# %% [markdown]
# PyTorch's `ZeroRedundancyOptimizer` does stage 1 around *any* optimizer, and so will yours:
# `Zero1(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01)`.
#
# 1. **Partition** the parameters among the ranks, whole tensors: sort them by size, largest
#    first (ties by position), and give each to the rank that owns the fewest elements so far
#    (ties to the lower rank). Every rank computes the same partition, with no communication.
# 2. Build **the real optimizer** over this rank's parameters only:
#    `optimizer_class(my_params, **defaults)`. Its state (AdamW's moments, SGD's momentum)
#    appears for those parameters alone, when it first steps.
# 3. `step()`: the gradients are already averaged over the ranks (data parallelism's job, as
#    before); update your parameters with your optimizer, then **broadcast** every parameter from
#    its owner (`dist.broadcast(p, src=owner)`), so every rank again holds all the new weights.
#
# Each parameter is then updated by the optimizer class itself, on the same tensor, with the
# same gradient as without sharding, so the weights must be **bit-identical** to the unsharded
# optimizer's: the test compares with `torch.equal`, not a tolerance. (A hand-written Adam that
# computes the first moment as `m.mul_(b1).add_(g, alpha=1 - b1)` where torch uses `m.lerp_(g, 1 - b1)`
# drifts by an ulp or two within a few steps; that is why you use the class.)
#
# The broadcasts add one copy of the weights to every step's traffic. The ZeRO paper's stage 1
# avoids it: an all-reduce *is* a reduce-scatter followed by an all-gather (the ring's two
# phases, section 4), so it reduce-scatters the gradients (each rank receives only the sum for
# its own shard), steps its shard, and all-gathers the weights: the same bytes as plain data
# parallelism, with useful work in between. Whole-tensor shards also balance only as well as the
# tensor sizes allow (one huge embedding ends up on one rank); flat shards of equal size, as FSDP
# uses, do not have that limit.

# %% [markdown]
# ### Your ZeRO-1
#
# Complete `Zero1`: the partition and the optimizer in `__init__` (keep the owner of each
# parameter, in the order of `self.params`), and `step()`. A rank that owns nothing (more ranks
# than parameters) has no optimizer at all. `zero.zero_trial` trains with your class on every
# rank, averages the gradients itself before each `step()`, and records them; the check replays
# the unsharded optimizer on those gradients and looks, from outside your class, at which
# parameters have optimizer state on which rank (every torch optimizer that steps is seen).

# %% nbgrader={"grade_id": "zero_code", "solution": true}
import torch
import torch.distributed as dist


class Zero1:
    """``optimizer_class`` over this rank's share of the parameters; every rank gets every new weight."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION
        self.owners = [0] * len(self.params)
        owned = [0] * self.world_size
        by_size = sorted(range(len(self.params)), key=lambda i: (-self.params[i].numel(), i))
        for i in by_size:
            rank = min(range(self.world_size), key=lambda r: (owned[r], r))
            self.owners[i] = rank
            owned[rank] += self.params[i].numel()
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        self.optimizer = optimizer_class(mine, **defaults) if mine else None
        ### END SOLUTION

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        """Step this rank's parameters with the real optimizer, then broadcast each from its owner."""
        ### BEGIN SOLUTION
        if self.optimizer is not None:
            self.optimizer.step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p, src=owner)
        ### END SOLUTION


# %% nbgrader={"grade_id": "zero1", "grade": true, "points": 2}
import functools

from fastdl_lab.distributed import ddp, run_world, zero

_model = functools.partial(ddp.small_mlp, 8, 9, 14, 3)
_data = ddp.make_regression(8, 48, 9, 3)
_runs = [("AdamW", {"lr": 0.02, "weight_decay": 0.05}), ("SGD", {"lr": 0.1, "momentum": 0.9})]
for _world in (2, 3):
    _per_rank = run_world(zero.zero_trial, _world, _model, _data, 3, _runs, zero_cls=Zero1)
    for _j, (_name, _defaults) in enumerate(_runs):
        zero.check_zero([_r[_j] for _r in _per_rank], _model, _name, _defaults, 3, name=f"Zero1, {_world} ranks")
print("zero1: visible tests passed")
### BEGIN HIDDEN TESTS
_hidden_runs = [("AdamW", {"lr": 0.05, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
                ("SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.01})]
for _hidden_world in (2, 4):
    _hidden = run_world(zero.zero_trial, _hidden_world, _model, _data, 4, _hidden_runs, zero_cls=Zero1)
    for _j, (_name, _defaults) in enumerate(_hidden_runs):
        zero.check_zero([_h[_j] for _h in _hidden], _model, _name, _defaults, 4, name=f"hidden, {_hidden_world} ranks")
### END HIDDEN TESTS

# %% [markdown]
# The AdamW state each rank holds, as the world grows, for a stack of eight equal layers (as
# measured from outside: the state of the optimizers that stepped on that rank):

# %%
def stack_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])


stack_data = ddp.make_regression(0, 48, 32, 32)
for world_size in (1, 2, 3, 4):
    held = run_world(zero.train_zero, world_size, stack_fn, stack_data, 1, torch.optim.AdamW, zero_cls=Zero1, lr=0.01)
    print(f"{world_size} rank(s): " + ", ".join(f"{r['state_bytes']:6d}" for r in held) + " B of AdamW state per rank")

# %% [markdown]
# ## 7. Backends, and what a larger batch buys
#
# Every collective so far went through **gloo**, one of the backends `torch.distributed` can
# sit on. Which operations a backend offers depends on where the tensors live. From the backend
# table of the `torch.distributed` documentation (PyTorch 2.x docs as of early 2026, without their
# XCCL columns; ✓ available, ✘ not, ? only when the MPI library PyTorch was built against is
# CUDA-aware):
#
# | operation | gloo, CPU | gloo, GPU | MPI, CPU | MPI, GPU | NCCL, CPU | NCCL, GPU |
# |---|---|---|---|---|---|---|
# | send / recv | ✓ | ✘ | ✓ | ? | ✘ | ✓ |
# | broadcast, all_reduce, reduce | ✓ | ✓ | ✓ | ? | ✘ | ✓ |
# | all_gather, gather, scatter | ✓ | ✓ | ✓ | ? | ✘ | ✓ |
# | reduce_scatter | ✓ | ✓ | ✘ | ✘ | ✘ | ✓ |
# | all_to_all | ✘ | ✘ | ✓ | ? | ✘ | ✓ |
# | barrier | ✓ | ✘ | ✓ | ? | ✘ | ✓ |
#
# gloo has since gained `all_to_all` (pytorch/pytorch#165435): the torch 2.13 this course installs
# runs it on CPU tensors, though the table above does not list it yet.
#
# Reading it: NCCL works on GPU tensors only, and is the one to use between GPUs (it alone drives
# NVLink, InfiniBand and GPUDirect); gloo covers the rest on CPU tensors, which is why this lab
# runs anywhere, and a subset on GPU tensors, more slowly than NCCL; MPI exists only in a PyTorch
# built from source on a machine with MPI installed, and has no reduce-scatter, the collective
# ZeRO and FSDP lean on. gloo and NCCL come with the usual Linux builds (NCCL with the CUDA ones).
#
# **Batch size.** Data parallelism on $N$ ranks, each with $b$ examples, *is* SGD with a batch of
# $Nb$ (section 2 proved it step for step). Adding ranks therefore raises the batch size, and
# the question becomes what a larger batch buys. Each step now averages more examples, so the
# gradient is less noisy and a larger learning rate is safe: the *linear scaling rule* (Goyal et
# al., 2017) multiplies the learning rate by the factor the batch grew by. While that holds, a
# batch $k$ times larger reaches the same loss in $k$ times fewer steps, and the same number of
# *examples*: perfect scaling. It stops holding once the learning rate hits the largest one that
# is stable (here about 1; at 2 this model diverges): beyond that, larger batches still take
# fewer steps but waste examples. The batch where this happens is the *critical batch size*
# (McCandlish et al., 2018); past it, more ranks buy little. One process simulates it below:

# %%
# One problem, split into examples to train on and held-out ones to measure with.
x_all, y_all = ddp.make_regression(11, 8192 + 1024, 12, 3)
(x_train, x_test), (y_train, y_test) = x_all.split([8192, 1024]), y_all.split([8192, 1024])


def minibatch_sgd(batch, lr, examples, points=12):
    """SGD with `batch` random examples per step until `examples` were seen; test loss along the way."""
    model = ddp.small_mlp(1, 12, 32, 3)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    draw = torch.Generator().manual_seed(batch)
    steps = examples // batch
    curve = []
    for step in range(1, steps + 1):
        rows = torch.randint(0, x_train.shape[0], (batch,), generator=draw)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x_train[rows]), y_train[rows]).backward()
        opt.step()
        if step % max(1, steps // points) == 0 or step == steps:
            with torch.no_grad():
                curve.append((step, step * batch, torch.nn.functional.mse_loss(model(x_test), y_test).item()))
    return curve


batches, examples = ((8, 64, 512), 2048) if QUICK else ((4, 16, 64, 256, 1024), 16384)
# Operations this small run several times faster on one thread than split over several.
threads = torch.get_num_threads()
torch.set_num_threads(1)
# Linear scaling from 0.02 at a batch of 4, up to the largest stable learning rate.
rates = {batch: min(0.005 * batch, 1.0) for batch in batches}
curves = {batch: minibatch_sgd(batch, lr, examples) for batch, lr in rates.items()}
torch.set_num_threads(threads)
fig, (by_step, by_example) = plt.subplots(1, 2, figsize=(10, 3.2))
for batch, lr in rates.items():
    steps, seen, loss = zip(*curves[batch])
    by_step.plot(steps, loss, label=f"batch {batch}, lr {lr:g}")
    by_example.plot(seen, loss, label=f"batch {batch}")
    print(f"batch {batch:5d}, lr {lr:5.2f}: {steps[-1]:5d} steps, test loss {loss[-1]:.4f}")
by_step.set_xscale("log")
by_step.set_xlabel("SGD steps")
by_example.set_xlabel("examples seen")
for ax in (by_step, by_example):
    ax.set_ylabel("test loss")
    ax.set_yscale("log")
by_step.legend(fontsize=7)
plt.show()

# %% [markdown]
# Read it: with linear scaling, the curves against *examples* coincide up to a batch of 64 — every
# doubling of ranks halves the steps for the same result. Once the learning rate is capped the
# large batches fall behind per example: there, more data-parallel ranks shorten each step's
# wall time less than they lengthen training.

# %% [markdown]
# ## 8. Sharding the weights too: FSDP (ZeRO-3)
#
# ZeRO-1 left every rank with every weight and every gradient. **Fully sharded data parallelism**
# (ZeRO stage 3; PyTorch's FSDP, Zhao et al., VLDB 2023) shards those too, so that a rank holds
# $1/N$ of the model in every form. The model is cut into **units** — here the blocks of an
# `nn.Sequential`, in a transformer one block each. Each unit's parameters are flattened into
# one vector (as in ZeRO-1), padded to a multiple of $N$, and rank $r$ keeps only the $r$-th of
# $N$ equal pieces, its **shard**. The parameters stay where they were, under their own names, as
# torch's FSDP keeps them with `use_orig_params=True` (and FSDP2 always): each layer's `weight` is
# now a 1-D view of the part of this rank's shard that falls inside it (empty where the weight
# lies in other ranks' shards), and the optimizer steps on those views. Code that finds a layer's
# weights by name (weight decay on linear weights only, a learning rate per layer) keeps working.
# A unit's full weights exist only while the unit computes:
#
# 1. **forward**: all-gather the shards into the unit's full flat vector, point the layers'
#    weights at views of it, run the unit, and **free** the vector;
# 2. **backward**: when the gradient reaches the unit's output, **gather again**, let autograd run
#    the unit's backward, then **reduce-scatter** the gradient of the flat vector — rank $r$
#    receives the sum over ranks of the gradients for its own shard — divide by $N$, hand it to
#    the parameters' views as their `.grad`, and free the vector again;
# 3. the optimizer steps on the parameters (views of the shards); nothing else is needed, since
#    the next forward gathers the new weights.
#
# Per step and unit that is two all-gathers and one reduce-scatter: 1.5 times the bytes of
# plain DDP's all-reduce, for a memory per rank of $16/N$ bytes per parameter (with Adam in mixed
# precision) plus one unit's weights at a time. Real FSDP also **prefetches**: it starts the
# next unit's all-gather while the current unit computes, so that the network and the arithmetic
# overlap, at the cost of a second unit in memory.
#
# **Freeing for real.** After the forward, autograd still holds the views it saved for the
# backward (a linear layer saves its weight). Dropping your own reference to the full vector
# would free nothing: the saved views keep its memory alive until the backward. FSDP frees the
# *storage* instead, `t.untyped_storage().resize_(0)`: the tensor, its views and autograd's
# saved copies all stay valid objects that now own zero bytes. Before the backward, the storage
# is resized back and all-gathered into again, so the saved views see the weights once more.
# One catch: autograd notices in-place writes through a *version counter* that views share with
# their base, and refuses to backward through a tensor changed since it was saved. Gather into
# the unit's own `full` buffer, and hand autograd `full.data` — a tensor on the same storage with
# a counter of its own — so the second gather does not count as a change.
#
# ### Your FSDP unit
#
# `FSDPUnit(module, compute_dtype=None)` below has its layout done (`fsdp.flat_layout`): the
# tensor `shard` (fp32, `shard_size` elements, `requires_grad`: the gradient of the flat vector
# arrives there, and a hook hands it on to the parameters' views), the module's parameters
# replaced by views of it under their own names (a weight tied between two layers of the unit,
# as a language model's embedding and output projection, stays one parameter), the buffer `full`
# (the whole padded vector, in the compute dtype, storage freed), `use_views(full)` to point the
# layers at a full vector, and `free()`, which frees it and points the layers back at their
# sharded parameters. Write:
#
# - `gather()`: give `full` its bytes back (`fsdp.allocate_storage`) and all-gather every rank's
#   shard into it, `dist.all_gather_single(self.full, my_shard)`, the shard cast to
#   `compute_dtype`; optionally, when `async_op=True`, start it asynchronously and keep the handle
#   in `self._pending`, which the next `gather()` then only waits on (prefetch);
# - `GatherParams`, the autograd function between the shard and the full vector: `forward` gathers
#   and returns `unit.full.data`; `backward` casts the incoming gradient to fp32,
#   `dist.reduce_scatter_single(shard_grad, grad)`, divides by the world size, frees the unit and
#   returns the shard's gradient (and `None` for `unit`);
# - `forward(x)`: `GatherParams.apply(self.shard, self)`, prefetch `self.next_unit` when it is
#   set, `use_views`, run the module on `x`, `free()`, register `before_backward` as a hook on
#   the output (`out.register_hook`), return the output. Cast `x` to `compute_dtype` only when
#   one is given and only if `x` is floating-point (`fsdp.cast_floating` does both): an
#   embedding's token ids must stay integers, as torch's FSDP leaves them;
# - `before_backward(grad)`: gather again, and point the layers at the full vector
#   (`use_views(self.full)`), so that anything that reads a layer's weight during its backward (a
#   hook, a forward recomputed to save memory) sees the full weight, as torch's FSDP arranges;
#   return nothing, so the gradient passes unchanged. `GatherParams.backward`'s `free()` puts
#   the sharded parameters back.
#
# Only all-gathers and reduce-scatters may move data here. `fsdp.train_fsdp` wraps each block of
# the model in your class and trains with SGD (momentum 0.9) on the model's parameters, which it
# expects under the model's own names (`fsdp.clean_name` drops the wrapper's
# `_fsdp_wrapped_module.`, as torch's FSDP does). It measures, from its
# own side of the process: the collectives (counted below `torch.distributed`), how many units
# were gathered at once, and, after the last step, the bytes of every tensor the training left
# alive in the rank apart from the data and the optimizer's state.

# %% nbgrader={"grade_id": "fsdp_code", "solution": true}
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
        ### BEGIN SOLUTION
        unit.gather()
        return unit.full.data
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_full):
        unit = ctx.unit
        ### BEGIN SOLUTION
        shard_grad = torch.empty_like(unit.shard)
        dist.reduce_scatter_single(shard_grad, grad_full.float().contiguous())
        shard_grad /= unit.world_size
        unit.free()
        return shard_grad, None
        ### END SOLUTION


class FSDPUnit(nn.Module):
    """One unit of a fully sharded model: its parameters are views of this rank's flat shard."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self._fsdp_wrapped_module = module  # torch's FSDP's name: fsdp.clean_name drops it
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = fsdp.flat_layout(module, self.world_size)
        flat = fsdp.flatten_padded(list(module.parameters()), self.shard_size * self.world_size)
        self.start = self.rank * self.shard_size
        self.shard = flat[self.start:self.start + self.shard_size].float().clone().requires_grad_()
        self.compute_dtype = compute_dtype  # None: no mixed precision, inputs left alone
        self.full = torch.empty(self.shard_size * self.world_size, dtype=compute_dtype or torch.float32)
        fsdp.free_storage(self.full)
        fsdp.drop_parameters(self.slots)
        self.params = fsdp.sharded_parameters(self.slots, self.shard, self.start)
        fsdp.register_sharded(self.slots, self.params)  # the layers' own names, views of the shard
        self.shard.register_post_accumulate_grad_hook(
            lambda shard: fsdp.grads_to_parameters(shard, self.slots, self.params, self.start))
        self.next_unit = None  # set by train_fsdp(..., prefetch=True)
        self._pending = None

    @property
    def module(self):
        return self._fsdp_wrapped_module

    def free(self):
        fsdp.free_storage(self.full)
        fsdp.register_sharded(self.slots, self.params)  # the layers hold their sharded parameters again

    def use_views(self, full):
        fsdp.place_views(self.slots, full)

    def gather(self, async_op=False):
        ### BEGIN SOLUTION
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        fsdp.allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.full.dtype), async_op=async_op)
        if async_op:
            self._pending = work
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        full = GatherParams.apply(self.shard, self)
        if self.next_unit is not None:
            self.next_unit.gather(async_op=True)
        self.use_views(full)
        out = self.module(fsdp.cast_floating(x, self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out
        ### END SOLUTION

    def before_backward(self, grad):
        ### BEGIN SOLUTION
        self.gather()
        self.use_views(self.full)
        ### END SOLUTION


# %% nbgrader={"grade_id": "fsdp", "grade": true, "points": 3}
import functools

from fastdl_lab.distributed import ddp, fsdp, run_world

_model = functools.partial(fsdp.unit_mlp, 6, [10, 21, 17, 26, 3])
_data = ddp.make_regression(6, 12, 10, 3)
_reference = fsdp.train_reference(_model, _data, 3, 0.1)
_results = run_world(fsdp.train_fsdp, 2, _model, _data, 3, 0.1, unit_cls=FSDPUnit)
fsdp.check_parity(_results, _reference, name="FSDPUnit, 2 ranks:")
_problems = fsdp.memory_problems(_results, _reference) + fsdp.wire_problems(_results, _reference, 3)
assert not _problems, _problems[0]
print(f"fsdp: visible tests passed; parameters per rank {_results[0]['memory']['param_bytes']} B of "
      f"{4 * sum(p.numel() for p in _reference.parameters())} B")
### BEGIN HIDDEN TESTS
_hidden_model = functools.partial(fsdp.unit_mlp, 13, [9, 30, 14, 22, 19, 4])
_hidden_data = ddp.make_regression(13, 18, 9, 4)
_hidden_reference = fsdp.train_reference(_hidden_model, _hidden_data, 4, 0.05)
_hidden_results = run_world(fsdp.train_fsdp, 3, _hidden_model, _hidden_data, 4, 0.05, unit_cls=FSDPUnit)
fsdp.check_parity(_hidden_results, _hidden_reference, name="hidden, 3 ranks:")
assert not (fsdp.memory_problems(_hidden_results, _hidden_reference)
            + fsdp.wire_problems(_hidden_results, _hidden_reference, 4))
_hidden_lm = functools.partial(fsdp.unit_lm, 11, 29, 12, 17, 3)
_hidden_lm_data = fsdp.make_token_data(11, 12, 5, 29, 3)
_hidden_lm_reference = fsdp.train_reference(_hidden_lm, _hidden_lm_data, 3, 0.1)
_hidden_lm_results = run_world(fsdp.train_fsdp, 3, _hidden_lm, _hidden_lm_data, 3, 0.1, unit_cls=FSDPUnit)
fsdp.check_parity(_hidden_lm_results, _hidden_lm_reference, name="hidden tied embedding, 3 ranks:")
### END HIDDEN TESTS

# %% [markdown]
# **Mixed precision.** FSDP's usual setting computes in bf16 while the optimizer updates fp32
# *master* shards: each gather moves the shards cast to bf16 (half the bytes), the unit's
# arithmetic runs in bf16, and the gradient is reduce-scattered in fp32 into the fp32 shard (the
# full bytes): $2 + 2 + 4 = 8$ bytes per parameter and step where fp32 moves $4 + 4 + 4 = 12$. Your
# class already has `compute_dtype`. The yardstick is the same training in one process that
# rounds where FSDP rounds: each rank's slice of the batch in bf16, the gradients averaged in fp32
# (`fsdp.train_reference(..., compute_dtype=torch.bfloat16, world_size=2)`); FSDP must be no
# further from fp32 training than twice that run's own error. The test below trains a model fed
# token ids: an embedding whose matrix is also the projection that follows it
# (`fsdp.unit_lm`), so the ids must reach it as integers, and the tie must hold.

# %% nbgrader={"grade_id": "fsdp_mixed", "grade": true, "points": 2}
import functools

import torch

from fastdl_lab.distributed import ddp, fsdp, run_world

_model = functools.partial(fsdp.unit_lm, 7, 48, 24, 32, 2)
_data = fsdp.make_token_data(7, 16, 6, 48, 2)
_reference = fsdp.train_reference(_model, _data, 3, 0.1)
_bf16 = fsdp.train_reference(_model, _data, 3, 0.1, compute_dtype=torch.bfloat16, world_size=2)
_results = run_world(fsdp.train_fsdp, 2, _model, _data, 3, 0.1, unit_cls=FSDPUnit, compute_dtype=torch.bfloat16)
fsdp.check_parity(_results, _reference, name="FSDPUnit bf16, 2 ranks:", lowp_reference=_bf16)
_problems = (fsdp.memory_problems(_results, _reference)
             + fsdp.wire_problems(_results, _reference, 3, compute_dtype=torch.bfloat16))
assert not _problems, _problems[0]
print(f"fsdp_mixed: visible tests passed; {_results[0]['wire']['gathered_bytes']} B gathered per rank in bf16")
### BEGIN HIDDEN TESTS
_hidden_model = functools.partial(fsdp.unit_mlp, 17, [8, 23, 11, 29, 5])
_hidden_data = ddp.make_regression(17, 12, 8, 5)
_hidden_reference = fsdp.train_reference(_hidden_model, _hidden_data, 4, 0.05)
_hidden_bf16 = fsdp.train_reference(_hidden_model, _hidden_data, 4, 0.05, compute_dtype=torch.bfloat16,
                                    world_size=3)
_hidden_results = run_world(fsdp.train_fsdp, 3, _hidden_model, _hidden_data, 4, 0.05, unit_cls=FSDPUnit,
                            compute_dtype=torch.bfloat16)
fsdp.check_parity(_hidden_results, _hidden_reference, name="hidden bf16:", lowp_reference=_hidden_bf16)
assert not (fsdp.memory_problems(_hidden_results, _hidden_reference)
            + fsdp.wire_problems(_hidden_results, _hidden_reference, 4, compute_dtype=torch.bfloat16))
### END HIDDEN TESTS

# %% [markdown]
# What each rank keeps, and what it moves, as the world grows (a wider model of six units;
# `max_live_buffers` is the most units still gathered when another was, so 1 with prefetch):

# %%
import functools

wide = functools.partial(fsdp.unit_mlp, 0, [64] * 7)
wide_data = ddp.make_regression(0, 24, 64, 64)
full_bytes = 4 * sum(p.numel() for p in wide().parameters())
print(f"the whole model: {full_bytes} B of fp32 weights")
worlds = ((1, False), (2, False), (2, True)) if QUICK else ((1, False), (2, False), (3, False), (4, False), (4, True))
for world_size, prefetch in worlds:
    r = run_world(fsdp.train_fsdp, world_size, wide, wide_data, 1, 0.05, unit_cls=FSDPUnit, prefetch=prefetch)[0]
    print(f"{world_size} rank(s){' + prefetch' if prefetch else '':>11}: weights {r['memory']['param_bytes']:6d} B, "
          f"everything kept {r['memory']['resident_bytes']:6d} B, gathered per step {r['wire']['gathered_bytes']:6d} B, "
          f"units gathered at once besides the new one: {r['wire']['max_live_buffers']}")

# %% [markdown]
# ## 9. Tensor parallelism: a column- then row-parallel MLP
#
# Data parallelism, sharded or not, still runs every layer whole on one device; it cannot make one
# layer faster or smaller than one device allows. **Tensor parallelism** splits the matrices of
# each layer (Shoeybi et al., *Megatron-LM*, 2019). For a transformer MLP
# $y = \mathrm{gelu}(x W_1 + b_1)\,W_2 + b_2$:
#
# - **column-parallel** $W_1$: rank $r$ holds a block of $W_1$'s columns (and the matching piece of
#   $b_1$) and computes its own slice of the hidden units, $h_r = \mathrm{gelu}(x W_{1,r} + b_{1,r})$,
#   from the whole input and with no communication — gelu acts element by element;
# - **row-parallel** $W_2$: rank $r$ holds the matching block of $W_2$'s rows, so $h_r W_{2,r}$ is its
#   partial sum of the output; one **all-reduce** adds the partials, then $b_2$ is added once.
#
# Backward mirrors it. The row-parallel layer's partial products each receive the whole output
# gradient (no communication), and the column-parallel layer's input gradient is a sum of every
# rank's contribution, $\partial x = \sum_r \partial h_r W_{1,r}^\top$: one all-reduce. Megatron
# writes the two as autograd functions that are each other's mirror: **f**, identity forward and
# all-reduce backward, at the entrance of the column-parallel layer; **g**, all-reduce forward and
# identity backward, at the exit of the row-parallel one. Two all-reduces of the activations per
# layer is a lot of traffic, so tensor parallelism stays inside a node, on NVLink.
#
# ### Your tensor-parallel MLP
#
# Write `CopyToTensorParallel` (f), `ReduceFromTensorParallel` (g), and the forwards of
# `ColumnParallelLinear` (`x @ weight + bias` behind f) and `RowParallelLinear` (`h @ weight`
# through g, then `+ bias`). Weights are stored as `x @ W` multiplies them, (d_in, d_out);
# `tensor_parallel.shard_mlp` cuts them (`torch.tensor_split`, so $d_\text{hidden}$ need not
# divide by $N$). Use the parameters the layers are given: `tensor_parallel.tp_trial` reads their
# gradients, and counts the all-reduces of each pass (only all-reduces may move data).

# %% nbgrader={"grade_id": "tp_code", "solution": true}
import torch
import torch.distributed as dist
from torch import nn


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the ranks."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad
        ### END SOLUTION


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward sums the partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx, partial):
        ### BEGIN SOLUTION
        total = partial.contiguous().clone()
        dist.all_reduce(total)
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad
        ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """This rank's block of output features, from the whole input."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        ### BEGIN SOLUTION
        return CopyToTensorParallel.apply(x) @ self.weight + self.bias
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """The whole output, from this rank's block of input features, summed over the ranks."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, h):
        ### BEGIN SOLUTION
        return ReduceFromTensorParallel.apply(h @ self.weight) + self.bias
        ### END SOLUTION


# %% nbgrader={"grade_id": "tp_mlp", "grade": true, "points": 3}
from fastdl_lab.distributed import run_world, tensor_parallel

for _world, _d_hidden in ((2, 24), (3, 17)):
    _results = run_world(tensor_parallel.tp_trial, _world, 3, 5, 8, _d_hidden, column_cls=ColumnParallelLinear,
                         row_cls=RowParallelLinear)
    tensor_parallel.check_tp(_results, 3, 5, 8, _d_hidden)
    assert not tensor_parallel.allreduce_problems(_results), tensor_parallel.allreduce_problems(_results)[0]
print("tp_mlp: visible tests passed")
### BEGIN HIDDEN TESTS
_hidden_layers = {"column_cls": ColumnParallelLinear, "row_cls": RowParallelLinear}
_hidden_results = run_world(tensor_parallel.tp_trial, 4, 21, 7, 11, 30, **_hidden_layers)
tensor_parallel.check_tp(_hidden_results, 21, 7, 11, 30)
assert not tensor_parallel.allreduce_problems(_hidden_results)
### END HIDDEN TESTS

# %% [markdown]
# Each rank holds $1/N$ of both matrices, and pays for it in activations on the wire:

# %%
seed, tokens, d_model, d_hidden = 0, 6, 16, 40
shard = tensor_parallel.shard_mlp(tensor_parallel.make_mlp(seed, d_model, d_hidden), 0, 2)
print("rank 0 of 2 holds", {name: tuple(t.shape) for name, t in shard.items()})
per_layer = tensor_parallel.allreduce_bytes_per_layer(2048 * 8, 8192, 2, 8)
print(f"forward all-reduce of one MLP, 8 ranks, 8 sequences of 2048 tokens, d_model 8192, bf16: "
      f"{per_layer / 1e6:.0f} MB per rank")

# %% [markdown]
# ## 10. Beyond: pipeline and sequence parallelism
#
# Two more axes split the model itself; large runs combine all of them ("3-D parallelism").
#
# **Pipeline parallelism** gives each rank a contiguous group of layers (a *stage*) and passes
# activations from stage to stage (GPipe, Huang et al. 2019; PipeDream's 1F1B schedule). Only
# activations at stage boundaries travel, so it crosses nodes well; the cost is the **bubble**:
# while the first micro-batch fills the pipeline and the last drains it, some stages idle. With
# $p$ stages and $m$ micro-batches per batch the idle fraction is $(p-1)/(m+p-1)$, hence many
# micro-batches:

# %%
fig, ax = plt.subplots(figsize=(5.5, 3.2))
micro = list(range(1, 65))
for stages in (2, 4, 8, 16):
    ax.plot(micro, [tensor_parallel.pipeline_bubble_fraction(stages, m) for m in micro], label=f"{stages} stages")
ax.set_xlabel("micro-batches per batch")
ax.set_ylabel("idle fraction (bubble)")
ax.set_xscale("log", base=2)
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# **Sequence parallelism** splits along the tokens. In Megatron's form (Korthikanti et al., 2022)
# the operations that tensor parallelism leaves replicated — LayerNorm, dropout, the residual
# additions — work on a $1/N$ slice of the sequence instead; the all-reduce around each
# tensor-parallel block becomes its two halves: an all-gather of the token slices before the
# block and a reduce-scatter back into slices after it. Same bytes, and each rank stores $1/N$ of
# those activations. `tensor_parallel.sequence_parallel_mlp` is the MLP in this form; each rank's
# output is its slice of the unsplit MLP's output (a parameter applied to the slices, such as the
# output bias here, gets partial gradients that are summed over the ranks):

# %%
per_rank = run_world(tensor_parallel.tp_trial, 2, seed, tokens, d_model, d_hidden, sequence_parallel=True)
tensor_parallel.check_tp(per_rank, seed, tokens, d_model, d_hidden, sequence_parallel=True)
print("each rank's output:", [tuple(r["y"].shape) for r in per_rank], "— its tokens of the unsplit MLP's output")

# %% [markdown]
# For very long contexts, **context parallelism** (ring attention, Liu et al. 2023) splits
# attention itself: each rank keeps a block of queries and passes blocks of keys and values
# around a ring, combining partial results with the online softmax of lab 05.
#
# | axis | splits | communicates | typical reach |
# |---|---|---|---|
# | data (+ ZeRO) | the batch (and optimizer state, gradients, weights) | gradients once per step | across nodes |
# | tensor | each layer's matrices | activations, twice per layer | inside a node |
# | pipeline | the layers | activations at stage boundaries | across nodes |
# | sequence / context | the tokens | activations (keys and values) | inside a node, or a ring of nodes |

# %% [markdown]
# ## Summary
#
# - Data parallelism is single-process SGD with one extra line: average the gradients with an
#   all-reduce. Equal shards and identical starting weights make it exact, so a DDP wrapper
#   broadcasts rank 0's parameters and buffers before anything else.
# - Launching each gradient's all-reduce from a hook overlaps communication with the rest of
#   backward; a collective costs a latency plus bytes over bandwidth, and buckets amortise the
#   latency. Collectives must be issued in the same order on every rank.
# - The ring all-reduce sends $2\frac{N-1}{N}$ times the tensor per rank, independently of $N$:
#   reduce-scatter, then all-gather, with non-blocking sends to avoid deadlock and chunks that
#   respect the remainder.
# - A parameter server trades exactness for never waiting. A drop rule caps how old an applied
#   gradient may be by discarding older ones; bounded delay and SSP cap it by making the fast
#   workers wait.
# - ZeRO shards what data parallelism replicates: optimizer state (stage 1) cuts Adam's 16 bytes
#   per parameter towards 4. Wrapping the real optimizer keeps the weights bit for bit those of
#   the unsharded one; reduce-scatter and all-gather instead of all-reduce and broadcast keep the
#   traffic that of plain data parallelism.
# - Each data-parallel rank adds to the global batch; with the learning rate scaled alongside,
#   that pays off up to a critical batch size, and no further.
# - FSDP (ZeRO-3) shards the weights and gradients too: each unit is gathered before its forward
#   and again before its backward, and freed after each by resizing its storage to nothing, so a
#   rank holds $1/N$ of the model plus a unit or two. Gathering in bf16 with fp32 master shards
#   halves the all-gathers only: with the gradient reduce-scattered in fp32, a step moves 8 bytes
#   per parameter instead of 12 (two gathers and one reduce-scatter), two thirds of the traffic.
# - Tensor parallelism splits each layer's matrices: a column- then row-parallel MLP costs one
#   all-reduce in forward and one in backward. Pipeline and sequence parallelism split the layers
#   and the tokens, each with its own communication pattern and reach.
