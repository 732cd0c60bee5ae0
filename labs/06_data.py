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
# # Lab 06 — Profiling and data pipelines: find the bottleneck, feed the device
#
# A GPU that waits is the most expensive idle machine in the building. It waits when the host
# stops to read a value back, when the host launches a hundred tiny kernels where one would do,
# when the batch is not ready because one Python process decodes every image, and when half of
# every batch is padding. None of these shows in the model's code as a bug; all of them show in a
# **profile**. In this lab you will:
#
# 1. profile a training step with `torch.profiler`, read the trace, count host syncs, FLOPs and
#    MFU, and find what is slow in a loop that has six problems planted in it *(section 1, about
#    30 minutes)*;
# 2. write the fixed loop: no host syncs, no constant uploaded every step, a vectorised step,
#    loader workers, per-batch padding, and exactly the same losses *(section 2, about
#    60 minutes; graded: `loop_syncs`, 3 points; `loop_losses`, 2 points; on GPU profiles
#    `loop_speed`, 2 points)*;
# 3. measure a DataLoader over real JPEGs: `num_workers`, `pin_memory`, `prefetch_factor`,
#    `persistent_workers`, decoding once or every epoch, augmenting per image or per batch
#    *(sections 3–4, about 60 minutes)*;
# 4. cut padding on real text lengths: a length-bucketing sampler *(section 5, about 60 minutes
#    for this item; graded: `bucket_sampler`, 3 points)* and sequence packing with the isolation
#    that makes it correct *(graded: `packing`, 3 points)*;
# 5. on a GPU host, see the same things with `nvidia-smi dmon` and Nsight Systems *(section 6,
#    about 10 minutes)*.
#
# **How this lab is graded.** The grader takes only your functions and classes (and literal
# constants) out of the solution cells and runs each on its own, with `math`, `np`, `torch`, `F`
# (`torch.nn.functional`), `DataLoader`, `Sampler`, `shuffle_sampler`, `PAD`, `Packed` and `pad_collate` as the only
# names available besides what it passes in: no imports inside them, no `getattr`/`eval`, no
# `_private` attributes of other objects, no assignments to attributes of anything but `self`. It
# counts syncs with the same `SyncCounter` you use below, entered by its own code around your
# calls, and draws its own hidden data.
#
# **Time:** about 3.75 hours for a student who has done the labs before it, by section in minutes:
# §1 30; §2 60; §3 40; §4 20; §5 60; §6 10. Graded code regions take most of it; the estimates are
# the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import inspect
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Sampler

from fastdl_lab import timing
from fastdl_lab.data import images, loaders, loop, profile, text
from fastdl_lab.data.syncs import SyncCounter
from fastdl_lab.data.loop import shuffle_sampler
from fastdl_lab.data.text import PAD, Packed, pad_collate  # noqa: F401  (the grader's names, for your cells)

DEVICE = "cuda" if device.has_gpu() else "cpu"
QUICK = device.quick()  # the grader's run of the notebook: ungraded experiments at tiny sizes

# %% [markdown]
# ## 1. A training step, profiled
#
# The model is a small text classifier: token embeddings, a mean over the real (non-padding)
# tokens, a two-layer MLP. The data is real text: the docstrings of the Python standard library
# installed on this machine, tokenised word by word. Their lengths are what real text lengths look
# like: most are short, a few are very long.

# %%
seqs = text.corpus(1024, seed=0, max_len=128)
dataset = loop.make_dataset(seqs)
lengths = np.array([len(s) for s in seqs])
print(f"{len(dataset)} docstrings; tokens per docstring: median {np.median(lengths):.0f}, "
      f"90th percentile {np.percentile(lengths, 90):.0f}, max {lengths.max()}")

# %% [markdown]
# Here is the training loop as someone first wrote it. It is correct: it trains. Read it once now;
# you will come back to it with the profiler's findings.

# %%
print(inspect.getsource(loop.train_slow))

# %% [markdown]
# ### Where does a step's time go?
#
# `profile.profile_steps` runs a function under `torch.profiler` (CPU activities, and CUDA ones on
# a GPU), skips the first calls (warm-up), records a few, and writes a **Chrome trace** you can
# open in `chrome://tracing` or [Perfetto](https://ui.perfetto.dev). `profile.summarise_trace`
# reads that file back: the ops that took the most time themselves, the host-side gaps where no
# op ran (Python between ops), and the ops that made the host wait for a value.

# %%
STEPS, BATCH = 4 if QUICK else 10, 32


def slow_run():
    model, optimizer = loop.fresh_run(0, device=DEVICE)
    return loop.train_slow(model, optimizer, dataset, steps=STEPS, batch_size=BATCH, seed=0, device=DEVICE)


# The grader's quick run profiles one step: a trace and a plot all the same. (The warm-up stays:
# without one the profiler warns that its results may be skewed.)
trace = profile.profile_steps(slow_run, steps=1 if QUICK else 2, warmup=1, name="slow_loop")
print("trace written to", trace)
print(profile.summarise_trace(trace, top=12))
profile.plot_timeline(trace, title="the slow loop's main thread: red is time in no op at all");

# %% [markdown]
# A profiler tells you *where* time goes; a counter tells you *why* the device would wait.
# `SyncCounter` counts, in the thread that runs the loop, three things named after what they cost
# on a GPU: **syncs** (the host needs a value from the device: `.item()`, `float(t)`, `if t:`,
# `.tolist()`, `.numpy()`, ops whose output size depends on values), **ops** (dispatched ops,
# roughly one kernel launch each on a GPU) and **uploads** (tensors made from host data and
# copied to the device). On this CPU the device is the CPU, and a value read back still counts:
# it would be a sync on a GPU.

# %%
with SyncCounter() as slow_counts:
    slow_run()
print(slow_counts.report(steps=STEPS))

# %% [markdown]
# ### FLOPs and MFU
#
# `torch.utils.flop_counter.FlopCounterMode` counts the FLOPs of the ops it has formulas for
# (matmuls, convolutions, attention): the useful work that model FLOP utilisation is defined on.
# With the step time and the peak you measured in lab 00, MFU is your lab 00 formula: achieved
# FLOP/s over peak FLOP/s.

# %%
model, optimizer = loop.fresh_run(0, device=DEVICE)
tokens, _, labels = pad_collate([dataset[i] for i in range(BATCH)])
tokens, labels = tokens.to(DEVICE), labels.to(DEVICE)


def one_step():
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(tokens), labels).backward()
    optimizer.step()


flops = profile.step_flops(one_step)
step_s = timing.bench(one_step, warmup=2, reps=10).median
roof = device.datasheet_roofline() if device.has_gpu() else device.measure_roofline()
achieved = flops / step_s / 1e12
print(f"{flops / 1e6:.1f} MFLOP per step in {step_s * 1e3:.2f} ms: {achieved * 1e3:.2f} GFLOP/s, "
      f"MFU {achieved / roof.tflops:.2%} of {roof.tflops:.2f} TFLOP/s ({roof.source})")

# %% [markdown]
# A model this small cannot keep any machine busy: its MFU is a few percent at best. That is not
# the lesson here. The lesson is the ratio between the time of the step *itself* (above) and the
# time per step of the whole loop (the profile): everything in between is overhead the loop adds.
#
# ### Your findings
#
# From the trace summary, the counter's report and the source, list what makes `train_slow` slow.
# There are six problems planted in it; each shows in at least one of the three views. Write them
# down here (not graded) before you fix them.
#
# 1. ...

# %% [markdown]
# ## 2. The fixed loop
#
# Write `make_loader` and `train_fast`:
#
# - `make_loader(dataset, *, batch_size, seed, device)` returns a `DataLoader` that visits the
#   data in **the same order** as `train_slow` (its `sampler=shuffle_sampler(dataset, seed)`: a
#   `RandomSampler` with its own seeded generator), pads each batch to **its own** longest
#   sequence (`pad_collate`), and prepares batches in worker processes (`num_workers`,
#   `persistent_workers`, `prefetch_factor`) and in pinned memory on a GPU (`pin_memory`).
# - `train_fast(model, optimizer, loader, *, steps, device)` trains for `steps` batches and
#   returns the per-step losses **as one tensor on the device**. Inside the loop: no `.item()`,
#   no `float()`, no host metrics, no tensor made from Python data, no loop over the batch.
#   Batches go to the device with `non_blocking=True`. The class weights (`loop.CLASS_WEIGHTS`,
#   printed below; your cell has them as the literal constant `LOSS_WEIGHTS`) are made into a
#   tensor once, before the loop.
#   When `steps` is more than one epoch, go on with the next epoch, as `train_slow` does.
#
# It must compute exactly what `train_slow` computes: the same batches in the same order, the
# class-weighted mean cross-entropy, the same optimizer steps. The grader compares your losses and
# the model's final weights with the original loop's on hidden data; it checks the batches of a
# loader your `make_loader` makes (each padded to its own longest sequence) and sees its worker
# processes from outside your code. `SyncCounter`'s syncs, ops and uploads are counted inside your
# own process, so they are self-reported: they are worth one of the item's three points.

# %%
CLASS_WEIGHTS = loop.CLASS_WEIGHTS
print("class weights:", CLASS_WEIGHTS)

# %% nbgrader={"grade_id": "loop_code", "solution": true}
LOADER_WORKERS, PREFETCH = 2, 4
LOSS_WEIGHTS = (1.0, 2.0, 0.5, 1.5)


def make_loader(dataset, *, batch_size, seed, device="cpu"):
    ### BEGIN SOLUTION
    pinned = str(device).startswith("cuda")
    return DataLoader(dataset, batch_size=batch_size, sampler=shuffle_sampler(dataset, seed), collate_fn=pad_collate,
                      num_workers=LOADER_WORKERS, prefetch_factor=PREFETCH, persistent_workers=True,
                      pin_memory=pinned)
    ### END SOLUTION


def train_fast(model, optimizer, loader, *, steps, device="cpu"):
    ### BEGIN SOLUTION
    weight = torch.tensor(LOSS_WEIGHTS, device=device)
    history = torch.zeros(steps, device=device)
    model.train()
    step = 0
    while step < steps:
        for tokens, _, labels in loader:
            if step == steps:
                break
            loss = F.cross_entropy(model(tokens.to(device, non_blocking=True)),
                                   labels.to(device, non_blocking=True), weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # the same SGD update as train_slow's
            history[step] = loss.detach()
            step += 1
    return history
    ### END SOLUTION


# %% nbgrader={"grade_id": "loop_syncs", "grade": true, "points": 3}
_model, _opt = loop.fresh_run(1, device=DEVICE)
with SyncCounter() as _counts:
    _losses = train_fast(_model, _opt, make_loader(dataset, batch_size=BATCH, seed=1, device=DEVICE),
                         steps=6, device=DEVICE)
print(_counts.report(steps=6))
assert isinstance(_losses, torch.Tensor) and _losses.shape == (6,), "return the losses as one tensor of shape (steps,)"
assert _counts.syncs == 0, f"{_counts.syncs} host syncs in 6 steps"
assert _counts.uploads <= 3, f"{_counts.uploads} uploads in 6 steps: is a tensor built from Python data every step?"
print("loop_syncs: visible tests passed")
### BEGIN HIDDEN TESTS
_loader = make_loader(dataset, batch_size=16, seed=5, device=DEVICE)
assert _loader.num_workers >= 1 and _loader.batch_size == 16
### END HIDDEN TESTS

# %% nbgrader={"grade_id": "loop_losses", "grade": true, "points": 2}
_model, _opt = loop.fresh_run(2, device=DEVICE)
_want = loop.train_slow(_model, _opt, dataset, steps=6, batch_size=BATCH, seed=2, device=DEVICE)
_model, _opt = loop.fresh_run(2, device=DEVICE)
_got = train_fast(_model, _opt, make_loader(dataset, batch_size=BATCH, seed=2, device=DEVICE), steps=6, device=DEVICE)
torch.testing.assert_close(_got.cpu(), torch.tensor(_want), rtol=1e-4, atol=1e-6)
print("loop_losses: visible tests passed: the same losses as train_slow")
### BEGIN HIDDEN TESTS
_model, _opt = loop.fresh_run(3, device=DEVICE)
_want = loop.train_slow(_model, _opt, dataset, steps=4, batch_size=8, seed=3, device=DEVICE)
_model, _opt = loop.fresh_run(3, device=DEVICE)
_got = train_fast(_model, _opt, make_loader(dataset, batch_size=8, seed=3, device=DEVICE), steps=4, device=DEVICE)
assert torch.allclose(_got.cpu(), torch.tensor(_want), rtol=1e-4, atol=1e-6)
### END HIDDEN TESTS

# %% [markdown]
# Compare the loops, counted and timed: the original, your loop with a single-process loader
# (the loop's own fixes alone), and your loop with your loader. On a GPU the fixes add up: the
# original stops the device at every `.item()` and every host metric, and launches a few kernels
# per example. On two CPU cores the "device" is the same two cores that run Python, collate and
# decode: worker processes compete with the training for them, and starting workers and passing
# batches between processes costs more than collating a few short sequences. Measure, do not
# assume: here the loader's settings belong to a GPU host, and the loop's own fixes win anywhere.

# %%
def fast_run(workers=True):
    model, optimizer = loop.fresh_run(0, device=DEVICE)
    loader = (make_loader(dataset, batch_size=BATCH, seed=0, device=DEVICE) if workers else
              DataLoader(dataset, batch_size=BATCH, sampler=shuffle_sampler(dataset, 0), collate_fn=pad_collate))
    return train_fast(model, optimizer, loader, steps=STEPS, device=DEVICE)


with SyncCounter() as fast_counts:
    fast_run()
for name, counts in (("train_slow", slow_counts), ("train_fast", fast_counts)):
    print(f"{name}: {counts.syncs / STEPS:.1f} syncs, {counts.ops / STEPS:.0f} ops, "
          f"{counts.uploads / STEPS:.1f} uploads per step")
reps = 2 if QUICK else 3
print("loop fixes, one process:", timing.compare(lambda: fast_run(workers=False), slow_run, warmup=1, reps=reps))
print("loop fixes + your loader:", timing.compare(fast_run, slow_run, warmup=1, reps=reps))

# %% nbgrader={"grade_id": "loop_speed", "grade": true, "points": 2}
if device.has_gpu():
    print("loop_speed: graded by the course's grader on a GPU profile (your loop against train_slow, A/B)")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## 3. Feeding the loop: DataLoader workers
#
# Text is cheap to prepare. Images are not: every item is a JPEG to decode (entropy decoding, an
# inverse DCT, colour conversion) and an augmentation to apply. `images.jpeg_corpus` makes
# distinct JPEGs from the real photographs that ship with scikit-learn and matplotlib;
# `loaders.JpegDataset` decodes and augments one per `__getitem__`, as a real dataset does.

# %%
jpegs = images.jpeg_corpus(64 if QUICK else 256, size=256, seed=0)
photos = loaders.JpegDataset(jpegs, size=128, seed=0)
per_item = timing.bench(lambda: photos[0], warmup=2, reps=20).median
print(f"{len(jpegs)} JPEGs, {sum(map(len, jpegs)) / len(jpegs) / 1024:.0f} KiB each on average; "
      f"one decode + augment: {per_item * 1e3:.2f} ms")

# %% [markdown]
# With `num_workers=0` the training process does that work itself, between steps: the device waits.
# With `num_workers=k`, k worker processes each build whole batches and hand them over through
# shared memory; `prefetch_factor` batches per worker are prepared ahead; `persistent_workers`
# keeps the workers alive between epochs instead of starting them again; `pin_memory` puts each
# batch in page-locked host memory, which the GPU can copy from asynchronously
# (`.to("cuda", non_blocking=True)`) while it computes. Measure:

# %%
configs = [dict(num_workers=w, persistent_workers=w > 0) for w in ((0, 2) if QUICK else (0, 1, 2, 4))]
if device.has_gpu():
    configs += [dict(num_workers=w, persistent_workers=True, pin_memory=True) for w in (2, 4)]
rows = loaders.sweep(photos, configs, batch_size=32, batches=2 if QUICK else 8, epochs=2)
for row in rows:
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()})
loaders.plot_sweep(rows)
plt.show()

# %% [markdown]
# On a machine with $c$ cores, throughput grows with workers until the workers and the training
# process use every core; past that, more workers only add start-up time and memory (each worker
# holds a copy of the dataset object). This machine has the core count printed at the top.
#
# ### Decode once, or every epoch?
#
# Decoding is the same work every epoch; only the augmentation must change. If the decoded images
# fit in memory, decode them once (`loaders.PreprocessedDataset`) and augment per item:

# %%
decoded = loaders.PreprocessedDataset(jpegs, size=128, seed=0)
print(timing.compare(lambda: [decoded[i] for i in range(32)], lambda: [photos[i] for i in range(32)],
                     warmup=1, reps=2 if QUICK else 5))
print(f"decoded once in {decoded.decode_s:.2f} s, holding {decoded.images.nbytes / 2**20:.0f} MiB "
      f"against {sum(map(len, jpegs)) / 2**20:.1f} MiB of JPEG")

# %% [markdown]
# ### Crossing to the device
#
# A prepared batch still has to reach the GPU, over the link between host and device. The
# arithmetic comes first, and it runs anywhere: one batch of 256 images of 3 × 224 × 224, sent as
# fp32 and as the uint8 a decoder produces, over the links' specified one-way bandwidths
# (`transfer.LINKS_GBS`):

# %%
from fastdl_lab.data import transfer

batch = (256, 3, 224, 224)
for dtype in (torch.float32, torch.uint8):
    nbytes = transfer.batch_bytes(batch, dtype)
    times = ", ".join(f"{name} {transfer.link_seconds_ref(nbytes, gbs) * 1e3:.2f} ms"
                      for name, gbs in transfer.LINKS_GBS.items())
    print(f"{str(dtype).removeprefix('torch.'):>7} batch, {nbytes / 1e6:5.1f} MB: {times}")

# %% [markdown]
# Those are floors: a copy reaches them only from **pinned** memory. From ordinary (pageable)
# host memory the driver first copies the bytes into a pinned staging buffer of its own, and the
# host waits for the whole copy. From pinned memory the GPU's copy engine reads the bytes itself,
# and `non_blocking=True` returns at once, so the copy of batch $i+1$ overlaps the kernels of
# batch $i$. Sending uint8 and converting on the device (section 4) moves a quarter of the bytes.
#
# On a GPU, the cell below times a pageable copy, a pinned asynchronous one and a 4096³ fp16
# matmul with the course's harness: compare the milliseconds of moving 256 MiB with the
# milliseconds of computing on what is already there.

# %%
if device.has_gpu():
    moved = transfer.copy_vs_matmul(nbytes=(32 if QUICK else 256) << 20, matmul_n=1024 if QUICK else 4096)
    for name, t in moved["timings"].items():
        print(f"{name:>28}: {t}, {moved['rates'][name]}")
else:
    print("needs a GPU: a host-to-device copy, pinned or pageable, needs a device to copy to")

# %% [markdown]
# **A ladder of latencies.** Every kind of work has a fixed cost that no amount of bandwidth
# removes, and small work is all fixed cost. `transfer.latency_ladder` measures one rung per kind
# on this machine: a Python call, one torch op on a one-element tensor, a small and a large copy
# in host memory, and on a GPU a launch, a synchronisation (`.item()`) and a 4-byte copy to the
# device. The last column converts each rung into the bytes the large copy would have moved in
# the same time: what a batch must be worth before its fixed costs stop mattering.

# %%
ladder = transfer.latency_ladder(reps=3 if QUICK else 20)
big = next(r for r in ladder if r["what"].startswith("copy 64 MiB"))
bytes_per_s = 2 * (64 << 20) / big["seconds"]  # read and write
for r in ladder:
    if r["seconds"] is None:
        print(f"{r['what']:>56}: {r['why']}")
    else:
        print(f"{r['what']:>56}: {r['seconds'] * 1e6:10.3f} µs  = {r['seconds'] * bytes_per_s / 1024:10.1f} KiB "
              f"of host copying ({r['why']})")

# %% [markdown]
# ## 4. Images: decoding and augmenting
#
# Two ways to decode less: ask the JPEG decoder for a smaller image (`Image.draft` makes libjpeg
# scale by 1/2, 1/4 or 1/8 *inside* the inverse DCT, so it never produces the full-size pixels),
# and on a GPU decode on the device (`torchvision.io.decode_jpeg(..., device="cuda")`, nvJPEG).

# %%
sample = jpegs[0]
decodes = {"PIL, full size": lambda: images.decode_pil(sample),
           "PIL draft, >= 128 px": lambda: images.decode_pil_draft(sample, 128)}
print({name: tuple(fn().shape) for name, fn in decodes.items()})
print(timing.table({name: timing.bench(fn, warmup=2, reps=3 if QUICK else 20) for name, fn in decodes.items()}))
try:
    print("nvJPEG:", timing.bench(lambda: images.decode_torchvision(sample, device="cuda"), warmup=2, reps=20))
except RuntimeError as exc:
    print(exc)

# %% [markdown]
# Augmenting one image at a time costs a few small ops per image; the same crops and flips on a
# whole batch cost a few ops per *batch*, which is what you want on a device (where every op is a
# launch). `images.augment_batch` applies the same random crops and flips as `augment_host` with
# batched ops:

# %%
batch = torch.stack([images.decode_pil_draft(j, 160)[:, :160, :160] for j in jpegs[:32]])
per_image = lambda: [images.augment_host(img, size=128, generator=torch.Generator().manual_seed(i))
                     for i, img in enumerate(batch)]
batched = lambda: images.augment_batch(batch, size=128, generator=torch.Generator().manual_seed(0))
print(timing.compare(batched, per_image, warmup=1, reps=2 if QUICK else 5))
with SyncCounter() as per_image_ops:
    per_image()
with SyncCounter() as batched_ops:
    batched()
print(f"ops for 32 images: {per_image_ops.ops} one by one, {batched_ops.ops} batched")

# %% [markdown]
# ## 5. Text: padding, bucketing, packing
#
# A batch of sequences is a rectangle: each row is padded to the longest row, and every padded
# slot costs the same compute as a real token. How much is padding depends on how the batch was
# formed. First, the real length distribution (all stdlib docstrings):

# %%
all_lengths = np.minimum(text.docstring_lengths(), 256)
plt.hist(all_lengths, bins=60, log=True)
plt.xlabel("tokens per docstring (cut at 256)")
plt.ylabel("docstrings")
plt.show()
print(f"{len(all_lengths)} docstrings; padding fraction padded to the dataset maximum: "
      f"{1 - all_lengths.sum() / (all_lengths.size * all_lengths.max()):.1%}; "
      f"random batches of 32 padded per batch: "
      f"{text.padding_fraction(text.random_batches(len(all_lengths), 32, 0), all_lengths):.1%}")

# %% [markdown]
# ### A length-bucketing sampler
#
# Padding per batch removes the waste of the global maximum, but a random batch still mixes a
# 5-token docstring with a 400-token one. **Bucketing** batches similar lengths together. Sorting
# the whole dataset by length would minimise padding, but then the batches would be the same, in
# the same order, every epoch: no shuffling, and training suffers. The usual compromise:
#
# 1. each epoch, shuffle all indices (with a generator seeded by `seed` and the epoch);
# 2. cut them into buckets of `bucket_size` indices (a few dozen batches' worth);
# 3. sort each bucket by length and cut it into batches;
# 4. shuffle the order of all batches.
#
# Write `BucketBatchSampler`: a `Sampler` that yields lists of indices (pass it to a `DataLoader`
# as `batch_sampler=`). `set_epoch(epoch)` is called before each epoch; `len()` is the number of
# batches. Every index must appear exactly once per epoch. The grader feeds it hidden real
# lengths and measures the padding of its batches (needs at most 12% at batch size 32), checks
# that the batches are full (a bucket's last batch may be short: at least 90% full on average),
# and that they change from epoch to epoch and do not come in length order.

# %% nbgrader={"grade_id": "sampler_code", "solution": true}
class BucketBatchSampler(Sampler):
    def __init__(self, lengths, batch_size, *, bucket_size=None, seed=0):
        self.lengths = [int(n) for n in lengths]
        self.batch_size = batch_size
        self.bucket_size = bucket_size or 50 * batch_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        n = len(self.lengths)
        buckets = [min(self.bucket_size, n - start) for start in range(0, n, self.bucket_size)]
        return sum(-(-size // self.batch_size) for size in buckets)

    def __iter__(self):
        ### BEGIN SOLUTION
        shuffler = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=shuffler).tolist()
        batches = []
        for start in range(0, len(order), self.bucket_size):
            bucket = sorted(order[start:start + self.bucket_size], key=lambda i: self.lengths[i])
            batches += [bucket[i:i + self.batch_size] for i in range(0, len(bucket), self.batch_size)]
        for b in torch.randperm(len(batches), generator=shuffler).tolist():
            yield batches[b]
        ### END SOLUTION


# %% nbgrader={"grade_id": "bucket_sampler", "grade": true, "points": 3}
_lengths = all_lengths[:1500]
_sampler = BucketBatchSampler(_lengths, 32, seed=0)
_epochs = []
for _e in range(2):
    _sampler.set_epoch(_e)
    _epochs.append([list(b) for b in _sampler])
for _batches in _epochs:
    assert sorted(i for b in _batches for i in b) == list(range(len(_lengths))), "every index exactly once per epoch"
    assert len(_batches) == len(_sampler) and max(map(len, _batches)) <= 32
_padding = text.padding_fraction(_epochs[0], _lengths)
print(f"bucketed padding {_padding:.1%} (random batches "
      f"{text.padding_fraction(text.random_batches(len(_lengths), 32, 0), _lengths):.1%})")
assert _padding <= 0.12, f"{_padding:.1%} padding"
assert _epochs[0] != _epochs[1], "the batches must change between epochs"
print("bucket_sampler: visible tests passed")
### BEGIN HIDDEN TESTS
_sampler = BucketBatchSampler(all_lengths[:777], 16, seed=3)
_sampler.set_epoch(4)
assert sorted(i for b in _sampler for i in b) == list(range(777))
### END HIDDEN TESTS

# %% [markdown]
# ### Packing: no padding at all, if the sequences stay apart
#
# **Packing** concatenates several sequences into one row of fixed length `max_len` and pads only
# the end of each row. It removes nearly all padding, but it is only correct if each sequence
# behaves exactly as it would alone:
#
# - its **position ids restart at 0** (a model with position embeddings would otherwise see the
#   third sequence of a row as starting at position 180);
# - its tokens **attend only to earlier tokens of the same sequence**: the attention mask is
#   block-diagonal (one causal block per sequence), not one causal triangle over the whole row.
#
# Write `pack_sequences(seqs, max_len)` (first-fit decreasing: longest sequences first, each into
# the first row with room; every sequence whole in one row) returning
# `Packed(tokens, position_ids, seq_ids)`, three `[rows, max_len]` long tensors, where `seq_ids`
# holds the index of the sequence that owns each slot and -1 for padding (token `PAD`, position 0);
# and `block_diagonal_mask(seq_ids)`, a bool `[rows, max_len, max_len]` tensor that is True where
# query $i$ may attend key $j$. The grader runs a small language model (`text.TinyLM`) on your
# packed rows and on every sequence alone, and compares the per-sequence losses.

# %% nbgrader={"grade_id": "packing_code", "solution": true}
def pack_sequences(seqs, max_len):
    ### BEGIN SOLUTION
    rows, room = [], []
    for i in sorted(range(len(seqs)), key=lambda k: -len(seqs[k])):
        n = len(seqs[i])
        if n > max_len:
            raise ValueError(f"sequence {i} has {n} tokens, more than a row of {max_len}")
        fits = [r for r, free in enumerate(room) if free >= n]
        if fits:
            rows[fits[0]].append(i)
            room[fits[0]] -= n
        else:
            rows.append([i])
            room.append(max_len - n)
    shape = (len(rows), max_len)
    tokens = torch.full(shape, PAD, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    seq_ids = torch.full(shape, -1, dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = len(seqs[i])
            tokens[r, at:at + n] = seqs[i]
            position_ids[r, at:at + n] = torch.arange(n)
            seq_ids[r, at:at + n] = i
            at += n
    return Packed(tokens, position_ids, seq_ids)
    ### END SOLUTION


def block_diagonal_mask(seq_ids):
    ### BEGIN SOLUTION
    same = seq_ids[:, :, None] == seq_ids[:, None, :]
    real = (seq_ids >= 0)[:, None, :]
    width = seq_ids.shape[-1]
    earlier = torch.ones(width, width, dtype=torch.bool).tril()
    return same & real & earlier
    ### END SOLUTION


# %% nbgrader={"grade_id": "packing", "grade": true, "points": 3}
_seqs = text.corpus(30, seed=11, max_len=64)
_packed = pack_sequences(_seqs, 64)
assert _packed.tokens.shape[1] == 64 and _packed.tokens.shape == _packed.seq_ids.shape == _packed.position_ids.shape
for _i, _s in enumerate(_seqs):
    assert torch.equal(_packed.tokens[_packed.seq_ids == _i], _s), f"sequence {_i} is not whole"
    assert torch.equal(_packed.position_ids[_packed.seq_ids == _i], torch.arange(len(_s))), f"positions of {_i}"
_lm = text.TinyLM(seed=0)
_alone = text.sequence_losses(_lm, _seqs)
_together = text.packed_sequence_losses(_lm, _packed, block_diagonal_mask(_packed.seq_ids))
torch.testing.assert_close(_together, _alone, rtol=1e-4, atol=1e-5)
print(f"packing: {len(_seqs)} sequences in {_packed.tokens.shape[0]} rows, same losses as alone; visible tests passed")
### BEGIN HIDDEN TESTS
_seqs = text.corpus(12, seed=12, max_len=40)
_packed = pack_sequences(_seqs, 40)
torch.testing.assert_close(text.packed_sequence_losses(_lm, _packed, block_diagonal_mask(_packed.seq_ids)),
                           text.sequence_losses(_lm, _seqs), rtol=1e-4, atol=1e-5)
### END HIDDEN TESTS

# %% [markdown]
# The four ways side by side, on every stdlib docstring cut at 256 tokens, with your sampler and
# your packing:

# %%
report = text.padding_report(text.docstring_lengths(), 32, 0, 256, sampler=BucketBatchSampler, pack=pack_sequences)
for name, fraction in report.items():
    print(f"{name:>12}: {fraction:6.1%} of the tokens computed are padding")

# %% [markdown]
# What packing costs: attention with a block-diagonal mask over a full row does the work of the
# whole row (the masked scores are computed and thrown away) unless the kernel skips masked
# blocks, which is what variable-length attention kernels (FlashAttention's `varlen` interface,
# with cumulative sequence lengths instead of a dense mask) do. Lab 05's causal kernel skips the
# blocks above the diagonal the same way.
#
# ## 6. On a GPU host: the tools
#
# Everything above runs on a GPU unchanged (`DEVICE` is `"cuda"` there). Three more tools see
# what only a GPU shows:
#
# - **`nvidia-smi dmon -s u -d 1`** prints, once a second, the fraction of time a kernel was
#   running (`sm`) and the memory controller was busy (`mem`). Run it in a terminal while the slow
#   loop trains, then the fast one: a starved GPU shows `sm` far below 100%.
# - **Nsight Systems**: `nsys profile -t cuda,nvtx,osrt -o slow python train.py`, then open the
#   report in the Nsight Systems GUI. One timeline shows the Python thread, the CUDA API calls, the
#   kernels and the copies: a `cudaStreamSynchronize` or `cudaMemcpy` DtoH after every step is the
#   `.item()`, gaps between kernels are the host falling behind. `torch.cuda.nvtx.range("step")`
#   marks your own regions on it.
# - **`torch.cuda.set_sync_debug_mode("warn")`** makes PyTorch warn at every op that synchronises
#   with the device: the GPU's own version of `SyncCounter`.
#
# The profiler's trace of this lab on a GPU host also has CUDA kernel rows and the copy engine's
# rows: open it in Perfetto and look for the gaps between kernels.
#
# ## Summary
#
# - Measure before you fix: the profiler says where time goes, a sync counter says why the device
#   waits, FLOPs and MFU say how far from the machine's limit you are.
# - A training loop should never ask the device for a value it does not need now: keep losses and
#   metrics on the device and read them once.
# - Every op is a launch: vectorise over the batch, make constants once.
# - Prepare data in parallel with training (workers, prefetching, pinned memory), decode once if
#   you can, augment per batch on the device.
# - Padding is compute spent on nothing: pad per batch, bucket by length, or pack, and when you
#   pack, keep the sequences apart with position ids and a block-diagonal mask.
