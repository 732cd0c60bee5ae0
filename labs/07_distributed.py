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
# 1. start a *world* of processes and use collectives;
# 2. turn single-process SGD into **data-parallel** SGD with an all-reduce of the gradients
#    *(graded: `ddp_parity`, 3 points)*;
# 3. make it cheaper with **gradient buckets** whose all-reduces overlap the backward pass
#    *(graded: `bucketed_ddp`, 3 points)*;
# 4. build the **ring all-reduce** from sends and receives, and see why it is bandwidth-optimal
#    *(graded: `ring_allreduce`, 3 points)*;
# 5. run a **parameter server** with asynchronous SGD, and bound the staleness of its gradients
#    *(graded: `parameter_server`, 3 points)*;
# 6. shard Adam's state across ranks with **ZeRO-1** *(graded: `zero1`, 2 points)*;
# 7. compare what the gloo, MPI and NCCL backends offer, and see what a larger global batch buys;
# 8. shard the weights themselves with **FSDP** (ZeRO-3), in fp32 and in bf16 with fp32 masters
#    *(graded: `fsdp`, 3 points; `fsdp_mixed`, 2 points)*;
# 9. split an MLP's matrices over the ranks: **tensor parallelism** *(graded: `tp_mlp`, 3 points)*;
# 10. survey pipeline and sequence parallelism.
#
# Everything runs on the CPU with the gloo backend: each *rank* is a separate process, and
# collectives travel over local TCP sockets. The same functions run on NCCL with a GPU per rank,
# and across machines, under `torchrun` (see the README, "Scaling past one machine"). On two CPU cores the
# interesting figures are the *mechanism* ones — bytes sent, calls made, staleness observed,
# state held — which are the same on any hardware; wall times say more about this machine than
# about the algorithms.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

from fastdl_lab import distributed
from fastdl_lab.distributed import RankFailure, ddp, ps, ring, run_world, tensor_parallel, zero

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
# identical. Two details make it exact: every rank must start from the same weights
# (`ddp.train_ddp` broadcasts rank 0's, as PyTorch's `DistributedDataParallel` does), and the
# slices must be the same size (otherwise the average must be weighted).

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
# ### Your gradient all-reduce
#
# Write `allreduce_gradients(model, world_size)`: after it returns, every parameter's `.grad` must
# hold the average over the ranks of that gradient. Use `dist.all_reduce` (it sums in place) and
# skip parameters whose `.grad` is `None`. `ddp.train_ddp` calls your function after every
# backward pass, on every rank.

# %% nbgrader={"grade_id": "ddp_code", "solution": true}
import torch.distributed as dist


def allreduce_gradients(model, world_size):
    """Average every parameter's gradient over the ranks, in place."""
    ### BEGIN SOLUTION
    for param in model.parameters():
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size
    ### END SOLUTION


# %% nbgrader={"grade_id": "ddp_parity", "grade": true, "points": 3}
from fastdl_lab.distributed import ddp, run_world


def _model():
    return ddp.small_mlp(5, 10, 16, 2)


_data = ddp.make_regression(5, 24, 10, 2)
_reference = ddp.train_reference(_model, _data, 4, 0.2)
for _world in (2, 3):
    _states = run_world(ddp.train_ddp, _world, _model, _data, 4, 0.2, sync=allreduce_gradients)
    ddp.check_parity(_states, _reference, name=f"{_world} ranks:")
print("ddp_parity: visible tests passed")
### BEGIN HIDDEN TESTS
def _hidden_model():
    return ddp.small_mlp(9, 7, 13, 3)


_hidden_data = ddp.make_regression(9, 36, 7, 3)
_hidden_reference = ddp.train_reference(_hidden_model, _hidden_data, 6, 0.15)
for _hidden_world in (2, 4):
    ddp.check_parity(run_world(ddp.train_ddp, _hidden_world, _hidden_model, _hidden_data, 6, 0.15,
                               sync=allreduce_gradients), _hidden_reference, name=f"hidden, {_hidden_world} ranks:")
### END HIDDEN TESTS

# %% [markdown]
# ## 3. Why buckets, and why overlap
#
# Your all-reduce is correct and slow in two ways.
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
# **Idle network during backward.** Backward produces gradients from the last layer to the
# first. The last layer's gradient is final long before backward ends, yet the naive version
# waits for all of them before sending anything; meanwhile the network sits idle, and afterwards
# the arithmetic units do.
#
# PyTorch's `DistributedDataParallel` (Li et al., *PyTorch Distributed*, VLDB 2020) fixes both:
#
# - gradients are packed into **buckets** of about `bucket_bytes` (25 MB by default), filled in
#   **reverse** parameter order — the order backward produces them — so there are few calls, each
#   large enough to amortise $\alpha$;
# - a **hook** on each parameter fires when its gradient has been accumulated; when the last
#   gradient of a bucket arrives, the bucket is flattened into one buffer and its all-reduce is
#   launched **asynchronously** (`async_op=True` returns a handle at once), so communication
#   overlaps the rest of backward;
# - before the optimizer step, `finish()` waits for the handles, divides by $N$ and copies the
#   averages back into the `.grad` tensors.
#
# One rule is easy to miss: collectives are matched by the order in which ranks issue them, not
# by name. If two ranks launched buckets in different orders, rank 0's bucket 1 would be summed
# with rank 1's bucket 0. Launch buckets strictly in bucket order: when a bucket completes before
# an earlier one, it waits for it.
#
# ### Your bucketed DDP
#
# Complete `BucketedDDP(module, bucket_bytes)`:
#
# - `__init__`: walk the parameters that require gradients in **reverse** order, appending each
#   to the current bucket; close the bucket as soon as it holds **at least** `bucket_bytes`
#   (`p.numel() * p.element_size()` each), and start a new one; the last bucket may be smaller.
#   So `bucket_bytes=1` gives one bucket per parameter, and a huge value a single bucket. Then
#   register `_grad_ready` on every such parameter with `p.register_post_accumulate_grad_hook`
#   (the hook receives the parameter);
# - `num_buckets`: how many buckets there are;
# - `_grad_ready(param)`: count the arrival; launch every bucket that is now complete, in order;
# - `_launch(index)`: flatten the bucket's gradients (`torch.cat` of `g.reshape(-1)`), start
#   `dist.all_reduce(flat, async_op=True)`, keep the buffer and the handle, add one to
#   `allreduce_calls`;
# - `finish()`: launch any bucket not launched yet (a parameter without a gradient counts as
#   zeros), wait for every handle, divide by the world size, copy each slice back into its
#   parameter's `.grad`, and reset for the next step.
#
# `ddp.train_ddp(..., sync=BucketedDDP, bucket_bytes=...)` builds your class once per rank and
# calls `finish()` after every backward pass.

# %% nbgrader={"grade_id": "bucketed_code", "solution": true}
import torch
import torch.distributed as dist


class BucketedDDP:
    """Average gradients over the ranks in buckets whose all-reduces overlap backward."""

    def __init__(self, module, bucket_bytes):
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.allreduce_calls = 0
        self.world_size = dist.get_world_size()
        ### BEGIN SOLUTION
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
        self.allreduce_calls += 1
        self.next_bucket = index + 1
        ### END SOLUTION

    def finish(self):
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
from fastdl_lab.distributed import ddp, run_world


def _model():
    return ddp.small_mlp(6, 10, 16, 2)


_data = ddp.make_regression(6, 32, 10, 2)
_reference = ddp.train_reference(_model, _data, 4, 0.2)
# Reversed, the parameters hold 8, 128, 64, 1024, 64 and 640 bytes: 700 makes two buckets.
for _bucket_bytes in (1, 700, 1 << 30):
    _states = run_world(ddp.train_ddp, 2, _model, _data, 4, 0.2, sync=BucketedDDP, bucket_bytes=_bucket_bytes)
    ddp.check_parity(_states, _reference, name=f"bucket_bytes={_bucket_bytes}:")
    _stats = run_world(ddp.bucket_stats, 2, _model, _data, _bucket_bytes, sync=BucketedDDP, steps=2)[0]
    _expected = ddp.expected_num_buckets(_model(), _bucket_bytes)
    assert _stats["num_buckets"] == _expected, f"bucket_bytes={_bucket_bytes}: {_stats['num_buckets']} buckets, expected {_expected}"
    assert _stats["allreduce_calls"] == 2 * _expected, f"bucket_bytes={_bucket_bytes}: {_stats['allreduce_calls']} all-reduces in 2 steps, expected one per bucket per step"
    assert _stats["launched_in_backward"] == _expected, f"bucket_bytes={_bucket_bytes}: only {_stats['launched_in_backward']} of {_expected} buckets were launched before backward returned"
print("bucketed_ddp: visible tests passed")
### BEGIN HIDDEN TESTS
def _hidden_model():
    return ddp.small_mlp(12, 9, 20, 4)


_hidden_data = ddp.make_regression(12, 30, 9, 4)
_hidden_reference = ddp.train_reference(_hidden_model, _hidden_data, 5, 0.1)
for _hidden_world, _hidden_bytes in ((3, 400), (2, 2000), (3, 80)):
    ddp.check_parity(run_world(ddp.train_ddp, _hidden_world, _hidden_model, _hidden_data, 5, 0.1,
                               sync=BucketedDDP, bucket_bytes=_hidden_bytes), _hidden_reference,
                     name=f"hidden, {_hidden_world} ranks, bucket_bytes={_hidden_bytes}:")
    _hidden_stats = run_world(ddp.bucket_stats, _hidden_world, _hidden_model, _hidden_data, _hidden_bytes,
                              sync=BucketedDDP, steps=3)[0]
    _hidden_count = ddp.expected_num_buckets(_hidden_model(), _hidden_bytes)
    assert _hidden_stats["num_buckets"] == _hidden_count, ("hidden bucket count", _hidden_stats, _hidden_count)
    assert _hidden_stats["allreduce_calls"] == 3 * _hidden_count, ("hidden call count", _hidden_stats)
### END HIDDEN TESTS

# %% [markdown]
# How much does it save here? A step of a wider MLP on 2 ranks with your two strategies (each
# rank is one thread on one core, so overlap has little idle time to fill; on GPUs the step
# computes on the device while the network transfers, and the gap is larger):

# %%
bench_data = ddp.make_regression(0, 256, 256, 256)


def bench_model():
    return ddp.small_mlp(0, 256, 512, 256)


step_times = {}
for label, sync, bucket_bytes in [("naive, one call per tensor", allreduce_gradients, 1),
                                  ("bucketed, 64 KiB", BucketedDDP, 64 << 10),
                                  ("bucketed, 1 MiB", BucketedDDP, 1 << 20)]:
    result = run_world(ddp.time_step, 2, bench_model, bench_data, sync, bucket_bytes, 2 if QUICK else 8)[0]
    step_times[label] = result["median_s"]
    print(f"{label:>28}: {result['median_s'] * 1e3:7.2f} ms per step, {result['calls_per_step']} all-reduces per step")

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
# - **Bounded staleness** (bounded delay): a gradient more than $\tau$ versions old is not
#   applied; its worker must pull the current weights and recompute. $\tau = 0$ admits only
#   gradients computed on the current weights; $\tau = \infty$ is asynchronous.
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
# and at this learning rate its final loss suffers; bounded staleness keeps the speed while
# capping the age, at the price of the slow worker's rejected (wasted) gradients. Note also who
# does the work: the fast workers make most updates, so their shards of the data weigh more —
# another bias asynchrony brings.

# %% nbgrader={"grade_id": "parameter_server", "grade": true, "points": 3}
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
# ## 6. Sharding the optimizer state: ZeRO-1
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
#
# ZeRO-1 costs no extra communication. An all-reduce *is* a reduce-scatter followed by an
# all-gather (the ring's two phases); ZeRO-1 simply does useful work in between:
#
# 1. flatten the gradients into one vector padded to a multiple of $N$, and **reduce-scatter** it:
#    rank $r$ receives the sum of everyone's gradients for its shard only;
# 2. divide by $N$ and run Adam on the shard, with `exp_avg` and `exp_avg_sq` of shard size;
# 3. **all-gather** the updated shards so that every rank holds all the new weights again.

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
# ### Your ZeRO-1 Adam
#
# `Zero1Adam` below has its layout done: the flattened parameters are `numel` elements, padded to
# `shard_size * world_size`; this rank owns elements `shard_start … shard_start + shard_size` of
# the flat vector, and its moments `exp_avg`, `exp_avg_sq` are that size. Write `step()`, which
# must reproduce `torch.optim.Adam` (no weight decay) exactly, for the step count $t$:
#
# $$m \leftarrow \beta_1 m + (1-\beta_1) g,\qquad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\qquad
#   \theta \leftarrow \theta - \frac{\text{lr}}{1-\beta_1^t}\cdot\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \varepsilon}$$
#
# - gradients: `self.flatten([...])` of every `p.grad` (zeros where `None`), then
#   `dist.reduce_scatter(my_grad, list(full.chunk(world_size)))` and divide by the world size;
# - update your shard of the flattened weights with the formula above;
# - `dist.all_gather(list(flat_weights.chunk(world_size)), my_new_shard)` (pass a copy of your
#   shard: it is also one of the outputs), then copy the result back into every parameter;
# - and `optimizer_state_bytes()`: the bytes of this rank's two moment tensors.
#
# Everything runs on every rank, and `step()` averages the gradients itself: `zero.train_zero`
# calls only `zero_grad()`, `backward()` and your `step()`.

# %% nbgrader={"grade_id": "zero_code", "solution": true}
import math

import torch
import torch.distributed as dist


class Zero1Adam:
    """Adam with exp_avg and exp_avg_sq kept only for this rank's 1/N of the parameters."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps = lr, betas, eps
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        self.shard_size = math.ceil(self.numel / self.world_size)
        self.shard_start = self.rank * self.shard_size
        first = self.params[0]
        self.exp_avg = torch.zeros(self.shard_size, dtype=first.dtype, device=first.device)
        self.exp_avg_sq = torch.zeros(self.shard_size, dtype=first.dtype, device=first.device)
        self.step_count = 0

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def flatten(self, tensors):
        """One vector of shard_size * world_size elements: the tensors, then zero padding."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.shard_size * self.world_size - self.numel))

    @torch.no_grad()
    def step(self):
        ### BEGIN SOLUTION
        full = self.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        my_grad = torch.empty(self.shard_size, dtype=full.dtype, device=full.device)
        dist.reduce_scatter(my_grad, list(full.chunk(self.world_size)))
        my_grad /= self.world_size

        self.step_count += 1
        beta1, beta2 = self.betas
        self.exp_avg.mul_(beta1).add_(my_grad, alpha=1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(my_grad, my_grad, value=1 - beta2)
        correction1 = 1 - beta1 ** self.step_count
        correction2 = 1 - beta2 ** self.step_count
        denominator = self.exp_avg_sq.sqrt() / math.sqrt(correction2) + self.eps
        flat_weights = self.flatten([p.detach() for p in self.params])
        mine = flat_weights[self.shard_start:self.shard_start + self.shard_size]
        mine -= self.lr / correction1 * self.exp_avg / denominator

        dist.all_gather(list(flat_weights.chunk(self.world_size)), mine.clone())
        start = 0
        for param in self.params:
            param.copy_(flat_weights[start:start + param.numel()].view_as(param))
            start += param.numel()
        ### END SOLUTION

    def optimizer_state_bytes(self):
        ### BEGIN SOLUTION
        return (self.exp_avg.numel() + self.exp_avg_sq.numel()) * self.exp_avg.element_size()
        ### END SOLUTION


# %% nbgrader={"grade_id": "zero1", "grade": true, "points": 2}
from fastdl_lab.distributed import ddp, run_world, zero


def _model():
    return ddp.small_mlp(8, 9, 14, 3)


_data = ddp.make_regression(8, 40, 9, 3)
_reference = zero.train_adam_reference(_model, _data, 3, 0.02)
_results = run_world(zero.train_zero, 2, _model, _data, 3, 0.02, optimizer_cls=Zero1Adam)
zero.check_zero(_results, _reference, name="Zero1Adam, 2 ranks:")
print(f"zero1: visible tests passed; state per rank {_results[0]['state_bytes']} B, "
      f"torch.optim.Adam {_reference['state_bytes']} B")
### BEGIN HIDDEN TESTS
_hidden_reference = zero.train_adam_reference(_model, _data, 4, 0.05, eps=0.1)
for _hidden_world in (2, 4):
    zero.check_zero(run_world(zero.train_zero, _hidden_world, _model, _data, 4, 0.05, optimizer_cls=Zero1Adam,
                              eps=0.1), _hidden_reference, name=f"hidden, {_hidden_world} ranks:")
### END HIDDEN TESTS

# %% [markdown]
# The state each rank holds, as the world grows:

# %%
for world_size in (1, 2, 3, 4):
    state = run_world(zero.train_zero, world_size, model_fn, ddp.make_regression(0, 48, 12, 3), 1, 0.01,
                      optimizer_cls=Zero1Adam)[0]["state_bytes"]
    print(f"{world_size} rank(s): {state:6d} B of Adam state per rank")

# %% [markdown]
# ## 7. Backends, and what a larger batch buys
#
# Every collective so far went through **gloo**, one of the backends `torch.distributed` can
# sit on. Which operations a backend offers depends on where the tensors live. From the
# `torch.distributed` documentation (PyTorch 2.x; ✓ available, ✘ not, ? only when the MPI
# library PyTorch was built against is CUDA-aware):
#
# | operation | gloo, CPU | gloo, GPU | MPI, CPU | MPI, GPU | NCCL, CPU | NCCL, GPU |
# |---|---|---|---|---|---|---|
# | send / recv | ✓ | ✘ | ✓ | ? | ✘ | ✓ |
# | broadcast, all_reduce, reduce | ✓ | ✓ | ✓ | ? | ✘ | ✓ |
# | all_gather, gather, scatter, all_to_all | ✓ | ✓ | ✓ | ? | ✘ | ✓ |
# | reduce_scatter | ✓ | ✓ | ✘ | ✘ | ✘ | ✓ |
# | barrier | ✓ | ✘ | ✓ | ? | ✘ | ✓ |
#
# Reading it: NCCL works on GPU tensors only, and is the one to use between GPUs (it alone drives
# NVLink, InfiniBand and GPUDirect); gloo covers everything on CPU tensors, which is why this lab
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
# $N$ equal pieces, its **shard**: the only parameter the optimizer ever sees. A unit's full
# weights exist only while the unit computes:
#
# 1. **forward**: all-gather the shards into the unit's full flat vector, point the layers'
#    weights at views of it, run the unit, and **free** the vector;
# 2. **backward**: when the gradient reaches the unit's output, **gather again**, let autograd run
#    the unit's backward, then **reduce-scatter** the gradient of the flat vector — rank $r$
#    receives the sum over ranks of the gradients for its own shard — divide by $N$, keep it as
#    the shard's `.grad`, and free the vector again;
# 3. the optimizer steps on the shards; nothing else is needed, since the next forward gathers
#    the new weights.
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
# parameter `shard` (fp32, `shard_size` elements), the buffer `full` (the whole padded vector, in
# the compute dtype, storage freed), the module's own parameters removed, `use_views(full)` to
# point the layers at a vector, and `free()`. Write:
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
#   set, `use_views`, run the module on `x` cast to `compute_dtype`, `free()`, register
#   `before_backward` as a hook on the output (`out.register_hook`), return the output;
# - `before_backward(grad)`: gather again (return nothing, so the gradient passes unchanged).
#
# Only all-gathers and reduce-scatters may move data here. `fsdp.train_fsdp` wraps each block of
# the model in your class and trains with SGD (momentum 0.9) on the shards. It measures, from its
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
    """One unit of a fully sharded model: its parameters live here as this rank's flat shard."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = fsdp.flat_layout(module, self.world_size)
        flat = fsdp.flatten_padded(list(module.parameters()), self.shard_size * self.world_size)
        start = self.rank * self.shard_size
        self.shard = nn.Parameter(flat[start:start + self.shard_size].float().clone())
        self.compute_dtype = compute_dtype or torch.float32
        self.full = torch.empty(self.shard_size * self.world_size, dtype=self.compute_dtype)
        fsdp.free_storage(self.full)
        for owner, name, _ in self.slots:
            delattr(owner, name)  # from now on the layers see views of self.full
        self.next_unit = None  # set by train_fsdp(..., prefetch=True)
        self._pending = None

    def free(self):
        fsdp.free_storage(self.full)

    def use_views(self, full):
        offset = 0
        for owner, name, shape in self.slots:
            setattr(owner, name, full[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()

    def gather(self, async_op=False):
        ### BEGIN SOLUTION
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        fsdp.allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.compute_dtype), async_op=async_op)
        if async_op:
            self._pending = work
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        full = GatherParams.apply(self.shard, self)
        if self.next_unit is not None:
            self.next_unit.gather(async_op=True)
        self.use_views(full)
        out = self.module(x.to(self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out
        ### END SOLUTION

    def before_backward(self, grad):
        ### BEGIN SOLUTION
        self.gather()
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
### END HIDDEN TESTS

# %% [markdown]
# **Mixed precision.** FSDP's usual setting computes in bf16 while the optimizer updates fp32
# *master* shards: each gather moves the shards cast to bf16 (half the bytes), the unit's
# arithmetic runs in bf16, and the gradient is reduce-scattered in fp32 into the fp32 shard. Your
# class already has `compute_dtype`. The yardstick is the same training in one process that
# rounds where FSDP rounds: each rank's slice of the batch in bf16, the gradients averaged in fp32
# (`fsdp.train_reference(..., compute_dtype=torch.bfloat16, world_size=2)`); FSDP must be no
# further from fp32 training than twice that run's own error.

# %% nbgrader={"grade_id": "fsdp_mixed", "grade": true, "points": 2}
import functools

import torch

from fastdl_lab.distributed import ddp, fsdp, run_world

_model = functools.partial(fsdp.unit_mlp, 7, [12, 19, 25, 16, 2])
_data = ddp.make_regression(7, 16, 12, 2)
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
#   all-reduce. Equal shards and identical starting weights make it exact.
# - A collective costs a latency plus bytes over bandwidth: bucketing amortises the latency, and
#   launching each bucket from a gradient hook overlaps communication with the rest of backward.
#   Collectives must be issued in the same order on every rank.
# - The ring all-reduce sends $2\frac{N-1}{N}$ times the tensor per rank, independently of $N$:
#   reduce-scatter, then all-gather, with non-blocking sends to avoid deadlock and chunks that
#   respect the remainder.
# - A parameter server trades exactness for never waiting; bounded staleness caps how old an
#   applied gradient may be.
# - ZeRO shards what data parallelism replicates: optimizer state (stage 1) cuts Adam's 16 bytes
#   per parameter towards 4 at no extra traffic.
# - Each data-parallel rank adds to the global batch; with the learning rate scaled alongside,
#   that pays off up to a critical batch size, and no further.
# - FSDP (ZeRO-3) shards the weights and gradients too: each unit is gathered before its forward
#   and again before its backward, and freed after each by resizing its storage to nothing, so a
#   rank holds $1/N$ of the model plus a unit or two; gathering in bf16 with fp32 master shards
#   halves the traffic.
# - Tensor parallelism splits each layer's matrices: a column- then row-parallel MLP costs one
#   all-reduce in forward and one in backward. Pipeline and sequence parallelism split the layers
#   and the tokens, each with its own communication pattern and reach.
