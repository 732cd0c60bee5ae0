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
# # Lab 00 — Measure: what can this machine do, and how do we know?
#
# Every later lab ends with a claim such as "this kernel is 3× faster" or "this step reaches
# 45% of peak". This lab gives you the tools to make such claims honestly:
#
# 1. **Peaks.** What the datasheets promise for the course GPUs, and what this machine
#    actually delivers when measured. *(sections 1 and 3, about 35 minutes)*
# 2. **The roofline model.** Why a kernel is limited either by arithmetic or by memory traffic,
#    how to tell which from two numbers, and from which batch size a layer stops being
#    memory-bound. *(section 2, about 30 minutes; graded: `roofline`, 4 points: 2 for the
#    calculators, 2 for the reasoning)*
# 3. **Timing.** Why the obvious timing loop lies on an asynchronous device, and the loop that
#    does not. *(section 4, about 40 minutes; graded: `timing`, 3 points)*
# 4. **The course harness** (`fastdl_lab.timing`) that every later lab uses, and **MFU**.
#    *(sections 5–6, about 30 minutes)*
#
# Write your code in the marked solution regions of the graded cells. The test cells below them
# give quick feedback; your grade comes from the autograder, which calls your functions on hidden
# inputs. Everything here runs on a CPU; cells that need a GPU say so and skip.
#
# **Time:** about 2.25 hours for a student who has done the labs before it, by section in minutes:
# §1 15; §2 30; §3 20; §4 40; §5 15; §6 15. Graded code regions take most of it; the estimates are
# the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import time

import matplotlib.pyplot as plt
import torch

from fastdl_lab import measure, timing

GPU = device.has_gpu()
DEV = "cuda" if GPU else "cpu"
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. What the datasheets promise
#
# A GPU datasheet gives two headline numbers per precision: the **peak arithmetic rate**
# (TFLOP/s, 10¹² floating-point operations per second) and the **memory bandwidth** (GB/s
# between the GPU's DRAM, HBM on data-centre parts, and its chip). The table below lists the
# GPUs this course knows the datasheets of (the grader has profiles for the T4, A100, H100 and
# H200; the L4 is there for comparison). Notice three things:
#
# - On the data-centre parts the tensor-core rates are 7–8× the plain fp32 rate in tf32 and
#   15–16× in fp16 and bf16 (the T4, without tf32, 8× in fp16). The L4, an inference card, gets
#   only 2× and 4×. Using tensor cores is the single largest speed lever on a modern GPU, and it
#   requires a matrix multiply.
# - Compute has grown much faster than bandwidth. The last two columns, the **ridge point**,
#   divide one by the other: the number of FLOPs a kernel must do per byte it moves before
#   arithmetic, not memory, becomes the bottleneck. On an H100 in fp16 that is about 300.
# - The H200 has exactly the H100's compute; it differs only in memory (more, and faster).
#   Memory-bound work gets faster on it, compute-bound work does not.

# %%
measure.peaks_table().round(1)

# %% [markdown]
# ## 2. The roofline model
#
# A kernel that performs $F$ floating-point operations and moves $B$ bytes to and from DRAM has
# **arithmetic intensity** $I = F / B$ (FLOP per byte). On a machine with peak compute $P$ and
# bandwidth $W$ it cannot run faster than either limit allows, so its attainable rate is
#
# $$ \text{attainable}(I) = \min\left(P,\; I \cdot W\right). $$
#
# Plotted on log-log axes this is a sloped line (the bandwidth roof) meeting a flat one (the
# compute roof) at the ridge point $I = P/W$. Kernels to the left of the ridge are
# *memory-bound*: making their arithmetic faster gains nothing, only moving fewer bytes helps.
# Kernels to the right are *compute-bound*.
#
# For a matrix multiply $C_{m\times n} = A_{m\times k} B_{k\times n}$:
#
# - each of the $mn$ outputs is a sum of $k$ products: one multiply and one add per term;
# - the least traffic any implementation can have is reading $A$ and $B$ once and writing $C$
#   once (real kernels move more; this is the bound the roofline uses).
#
# Units: keep peaks in TFLOP/s and bandwidth in GB/s, as in the table above. Then
# $I \cdot W$ is in GFLOP/s; divide by 1000 for TFLOP/s.
#
# **Model FLOP utilisation (MFU)** is the fraction of the peak that a program's *useful* FLOPs
# achieve: achieved TFLOP/s divided by peak TFLOP/s. It is the standard efficiency figure for
# training large models.
#
# **Your task, part 1 (half the item):** implement the five calculators below.
#
# **Part 2 (the other half): from which batch is a layer compute-bound?** A linear layer
# applied to a batch of $b$ tokens is a matrix multiply: activations $X$ ($b \times d_{in}$) times
# weights $W$ ($d_{in} \times d_{out}$) gives $Y$ ($b \times d_{out}$). Write
# `compute_bound_batch(d_in, d_out, bytes_per_elem, peak_tflops, peak_bw_gbs)`: the smallest
# batch $b \ge 1$ for which the layer's arithmetic intensity, with the least traffic as above,
# is at least the machine's ridge point, or `None` if no batch, however large, gets there.
#
# Reason it out before you code: how do the FLOPs and the bytes grow with $b$? Which term of
# the traffic does not grow at all, and what does that do to the intensity of a batch of one
# token (generating text one token at a time) and of a very large batch? Some layers need
# batches of millions of tokens, so trying $b = 1, 2, 3, \ldots$ in turn is too slow; a closed
# form or a bisection is not. The tests give you two answers to check against, not a formula.

# %% nbgrader={"grade_id": "roofline_code", "solution": true}
def matmul_flops(m, n, k):
    """Floating-point operations of an (m x k) @ (k x n) matrix multiply."""
    ### BEGIN SOLUTION
    return 2 * m * n * k
    ### END SOLUTION


def matmul_bytes(m, n, k, bytes_per_elem):
    """Least DRAM traffic in bytes: A and B read once, C written once."""
    ### BEGIN SOLUTION
    return (m * k + k * n + m * n) * bytes_per_elem
    ### END SOLUTION


def arithmetic_intensity(flops, bytes_moved):
    """FLOP per byte."""
    ### BEGIN SOLUTION
    return flops / bytes_moved
    ### END SOLUTION


def attainable_tflops(intensity, peak_tflops, peak_bw_gbs):
    """Roofline bound in TFLOP/s for a kernel of this intensity (FLOP/byte)."""
    ### BEGIN SOLUTION
    return min(peak_tflops, intensity * peak_bw_gbs / 1e3)
    ### END SOLUTION


def mfu(achieved_tflops, peak_tflops):
    """Model FLOP utilisation, a fraction between 0 and 1."""
    ### BEGIN SOLUTION
    return achieved_tflops / peak_tflops
    ### END SOLUTION


def compute_bound_batch(d_in, d_out, bytes_per_elem, peak_tflops, peak_bw_gbs):
    """Smallest batch b >= 1 at which a (b x d_in) @ (d_in x d_out) layer reaches the ridge; None if none does."""
    ### BEGIN SOLUTION
    import math

    ridge = peak_tflops * 1e3 / peak_bw_gbs
    # b * (2 d_in d_out - ridge e (d_in + d_out)) >= ridge e d_in d_out: the weights' bytes do not
    # grow with b, so the intensity rises towards 2 d_in d_out / ((d_in + d_out) e) and no further.
    slope = 2 * d_in * d_out - ridge * bytes_per_elem * (d_in + d_out)
    if slope <= 0:
        return None
    return max(1, math.ceil(ridge * bytes_per_elem * d_in * d_out / slope))
    ### END SOLUTION


# %% nbgrader={"grade_id": "roofline", "grade": true, "points": 4}
import math

assert matmul_flops(2, 3, 4) == 48, "one multiply and one add per term of every output's sum"
assert matmul_bytes(2, 3, 4, 4) == 104, "A (2x4) + B (4x3) + C (2x3) elements, 4 bytes each"
assert math.isclose(arithmetic_intensity(48, 104), 48 / 104)
assert math.isclose(attainable_tflops(1.0, 100.0, 2000.0), 2.0), "1 FLOP/B x 2000 GB/s = 2 TFLOP/s"
assert math.isclose(attainable_tflops(1000.0, 100.0, 2000.0), 100.0), "past the ridge: the compute roof"
assert math.isclose(mfu(50.0, 200.0), 0.25)
# A machine with a ridge of 100 FLOP/B, fp16 layers.
assert compute_bound_batch(1024, 1024, 2, 100.0, 1000.0) == 125, compute_bound_batch(1024, 1024, 2, 100.0, 1000.0)
assert compute_bound_batch(100, 100, 2, 100.0, 1000.0) is None, "100 x 100 weights: can any batch reach 100 FLOP/B?"
print("roofline: visible tests passed")
### BEGIN HIDDEN TESTS
assert matmul_flops(1, 1, 1) == 2
assert matmul_flops(4096, 4096, 4096) == 2 * 4096**3
assert matmul_flops(3, 5, 7) == matmul_flops(5, 3, 7) == 210
assert matmul_bytes(4096, 4096, 4096, 2) == 3 * 4096**2 * 2
assert matmul_bytes(1, 1000, 1000, 1) == 1000 + 1000 * 1000 + 1000
assert math.isclose(arithmetic_intensity(2 * 8192**3, 3 * 8192**2 * 2), 8192 / 3)
for ai in (0.01, 0.5, 10.0, 295.3, 295.4, 1e4):
    expected = min(989.4, ai * 3350.0 / 1e3)
    assert math.isclose(attainable_tflops(ai, 989.4, 3350.0), expected), ai
assert math.isclose(mfu(989.4, 989.4), 1.0)
assert math.isclose(mfu(0.3, 19.5), 0.3 / 19.5)
assert compute_bound_batch(4096, 4096, 2, 989.4, 3350.0) == 346
assert compute_bound_batch(8192, 1024, 1, 1979.0, 3350.0) == 438
assert compute_bound_batch(4096, 4096, 4, 67.0, 3350.0) == 41
assert compute_bound_batch(512, 512, 2, 989.4, 3350.0) is None
### END HIDDEN TESTS

# %% [markdown]
# ### Where do square matrix multiplies sit on an H100?
#
# For an $n\times n\times n$ product in fp16 the intensity is $2n^3 / (3n^2\cdot 2) = n/3$ FLOP/B.
# With the H100's ridge near 300 FLOP/B, only products with $n$ in the high hundreds or more can
# reach the compute roof, even in principle. Small GEMMs, the kind a small batch or a narrow layer
# produces, are memory-bound on big GPUs. An element-wise add ($1$ FLOP per 3 values moved) sits
# far to the left.

# %%
h100 = device.datasheet_roofline("H100", torch.float16)
placed = {}
for n in (64, 256, 1024, 8192):
    ai = arithmetic_intensity(matmul_flops(n, n, n), matmul_bytes(n, n, n, 2))
    placed[f"GEMM n={n}"] = (ai, attainable_tflops(ai, h100.tflops, h100.bandwidth_gbs))
    print(f"n={n:5d}: {ai:8.1f} FLOP/B -> at most {placed[f'GEMM n={n}'][1]:7.1f} TFLOP/s "
          f"({'memory' if ai < h100.ridge_intensity else 'compute'}-bound)")
add_ai = arithmetic_intensity(1, 3 * 2)
placed["add (fp16)"] = (add_ai, attainable_tflops(add_ai, h100.tflops, h100.bandwidth_gbs))
measure.plot_roofline(h100, placed, title="H100 datasheet roofline, fp16 tensor cores (upper bounds)")
plt.show()

# %% [markdown]
# The same question for a layer of a model being served: below the batch your
# `compute_bound_batch` finds, the GPU spends its time reading weights, and adding requests to
# the batch is almost free. A GPU with more bandwidth for the same compute (the H200) gets
# there with smaller batches.

# %%
for key in ("t4", "a100", "h100", "h200"):
    peak = device.PEAKS[key]
    batch = compute_bound_batch(4096, 4096, 2, peak.fp16_tflops, peak.mem_bw_gbs)
    print(f"{peak.name:>16}: a 4096 x 4096 fp16 layer is compute-bound from a batch of {batch} tokens")

# %% [markdown]
# ## 3. The roofline of *this* machine, measured
#
# Datasheet figures are upper bounds. `device.measure_roofline()` measures both roofs here: the
# bandwidth roof from a large copy (each byte read once and written once), the compute roof
# from a large matrix multiply. We then time a few operations with the course harness and place
# them on the measured roofline.
#
# On a CPU, expect the measured bandwidth to depend heavily on whether the data fits in cache —
# a large last-level cache can make a "DRAM" copy look several times faster than DRAM. On a GPU
# the copy is sized well past the L2 cache.

# %%
roof = device.measure_roofline(copy_bytes=4 << 20, matmul_n=256, reps=2) if QUICK else device.measure_roofline()
print(f"measured: {roof.bandwidth_gbs:,.1f} GB/s, {roof.tflops:.3g} TFLOP/s fp32, "
      f"ridge {roof.ridge_intensity:.1f} FLOP/B")
sheet = device.datasheet_roofline(dtype=torch.float32) if GPU else None
if sheet is not None:
    print(f"datasheet: {sheet.bandwidth_gbs:,.0f} GB/s, {sheet.tflops:.3g} TFLOP/s fp32 "
          f"-> measured {roof.bandwidth_gbs / sheet.bandwidth_gbs:.0%} and {roof.tflops / sheet.tflops:.0%}")

# %%
VEC = (1 << 16) if QUICK else (1 << 26) if GPU else (1 << 22)
REPS = 3 if QUICK else 10
x, y = torch.rand(VEC, device=DEV), torch.rand(VEC, device=DEV)
out = torch.empty_like(x)
t_add = timing.bench(lambda: torch.add(x, y, out=out), warmup=2, reps=REPS)
points = {"add": (arithmetic_intensity(VEC, 3 * 4 * VEC), VEC / t_add.median / 1e12)}
print(f"add of {VEC:,} floats: {t_add}")

for n in ((64, 256) if QUICK else (256, 1024, 4096) if GPU else (64, 256, 768)):
    a, b = torch.randn(n, n, device=DEV), torch.randn(n, n, device=DEV)
    c = torch.empty_like(a)
    t = timing.bench(lambda: torch.mm(a, b, out=c), warmup=2, reps=REPS)
    achieved = matmul_flops(n, n, n) / t.median / 1e12
    ai = arithmetic_intensity(matmul_flops(n, n, n), matmul_bytes(n, n, n, 4))
    points[f"mm {n}"] = (ai, achieved)
    print(f"mm {n:4d}: {t}  {achieved:.3g} TFLOP/s = "
          f"{achieved / attainable_tflops(ai, roof.tflops, roof.bandwidth_gbs):.0%} of its roofline bound")

measure.plot_roofline(roof, points)
plt.show()

# %% [markdown]
# The small matrix multiply lands well below its bound: at that size fixed per-call costs
# (dispatching the operator, waking worker threads, on a GPU the kernel launch) dominate the few
# microseconds of arithmetic. That is a third limit the roofline does not draw — **overhead** —
# and lab 02 returns to it.

# %% [markdown]
# ## 4. Why naive timing lies
#
# A GPU runs asynchronously. `torch.mm(a, b)` on a CUDA tensor does not multiply anything
# before returning: it appends a kernel to a queue (a *stream*) and returns to Python at once,
# while the GPU works through the queue in the background. Three consequences:
#
# 1. **A missing synchronize.** A timer read right after a launch measures how long it took to
#    *enqueue* the work — a few microseconds — not the work itself.
# 2. **First-call costs.** The first call of a kernel pays for JIT compilation (Triton,
#    `torch.compile`), lazy loading of GPU code, allocator growth, clocks ramping up from idle.
#    Timing it with the rest inflates the average. Run warm-up calls first and discard them.
# 3. **Hidden synchronizations.** Anything that needs a value on the host — `.item()`,
#    `print(tensor)`, `.cpu()`, `.tolist()`, an `if` on a GPU tensor — waits for the queue to
#    drain. It makes a sloppy timing accidentally right, and makes a training loop slow,
#    because the host can no longer run ahead of the GPU.
#
# Your CPU has no queue to show this, so `measure.SimulatedAsyncDevice` provides one: `launch()`
# enqueues an op that takes `op_seconds` on a background worker and returns immediately; the
# first op pays `compile_seconds` extra; `synchronize()` waits for the queue to drain; `result()`
# waits and returns a value, like `.item()`. Its ops take 20 ms here.
#
# Below, two loops time the same op ten times, one sample per iteration, and the plot shows
# every sample. The **naive** loop reads the clock as soon as `launch()` returns. The second
# waits with `synchronize()` before reading the clock, but starts timing from the very first
# call.

# %%
OP, COMPILE = (0.005, 0.1) if QUICK else (0.02, 0.4)
ITERS = 10


pitfalls = {}
with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
    pitfalls["no synchronize"] = measure.time_op_naive(dev, ITERS)  # each sample: start, launch(), stop
    queued = dev.pending
with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
    samples = []
    for _ in range(ITERS):
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        samples.append(time.perf_counter() - start)
    pitfalls["synchronize,\nno warm-up"] = samples
timing.plot_samples(pitfalls, truth_s=OP,
                    title=f"{ITERS} timed iterations each; {queued} ops still queued when the naive loop stopped")
plt.show()

# %% [markdown]
# The naive loop's dots sit a thousand times below the dashed line: it timed `launch()`, and
# most of the work was still queued when it stopped. With a synchronize every dot but the first
# sits on the line; the first (ringed) paid for the compilation, and drags the mean — the one
# number a loop reports when it divides its total by its count — far above the truth. With 100
# iterations the mean would come closer, with 3 it would move further away: a result that
# depends on the loop count is not measuring the op.
#
# Hidden synchronizations cost real time in a loop where the host has its own work to do. Below
# each step has 10 ms of host work (say, preparing the next batch) and one 20 ms device op. If
# the host never waits, the two overlap and a step costs about 20 ms; reading a result every step
# (`loss.item()` for logging) serializes them.

# %%
def train_like_loop(dev, steps, read_every_step):
    t0 = time.perf_counter()
    for _ in range(steps):
        time.sleep(OP / 2)  # host work for the next step
        dev.launch()
        if read_every_step:
            dev.result()  # like loss.item(): waits for the device
    dev.synchronize()  # let the last step finish
    return (time.perf_counter() - t0) / steps


with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=0.0) as dev:
    overlapped = train_like_loop(dev, 10, read_every_step=False)
    serialized = train_like_loop(dev, 10, read_every_step=True)
print(f"per step: {overlapped * 1e3:.1f} ms overlapped, {serialized * 1e3:.1f} ms with a read every step")

# %% [markdown]
# **Your task:** write `time_op(dev, iters=10, warmup=2)` returning a list of `iters`
# per-iteration times in seconds for one op on a `SimulatedAsyncDevice`. Run `warmup` launches
# first and make sure they have finished before timing; then for each iteration, time one launch
# *including* its completion. One sample per iteration (not a single average) lets you see the
# spread, which is what the harness reports as the inter-quartile range.
#
# The autograder hands `time_op` a device with the same methods and counters that runs outside
# your process, on the grader's clock, and keeps its own record of every launch and synchronize:
# the grade rests on that record, and your samples must agree with it.

# %% nbgrader={"grade_id": "timing_code", "solution": true}
import time


def time_op(dev, iters=10, warmup=2):
    """Per-iteration seconds of one op on ``dev``, after ``warmup`` discarded launches."""
    ### BEGIN SOLUTION
    for _ in range(warmup):
        dev.launch()
    dev.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        samples.append(time.perf_counter() - start)
    return samples
    ### END SOLUTION


# %% nbgrader={"grade_id": "timing", "grade": true, "points": 3}
from fastdl_lab import measure

with measure.SimulatedAsyncDevice(op_seconds=0.01, compile_seconds=0.2) as _dev:
    _samples = time_op(_dev, iters=5, warmup=2)
assert len(_samples) == 5, "one sample per iteration"
assert min(_samples) >= 0.01, "a sample shorter than the op: is the launch waited for?"
assert max(_samples) < 0.2, "a sample includes the first call's compile time: warm up first"
print("timing: visible tests passed; samples (ms):", [round(s * 1e3, 2) for s in _samples])
### BEGIN HIDDEN TESTS
with measure.SimulatedAsyncDevice(op_seconds=0.015, compile_seconds=0.3) as _dev:
    _samples = time_op(_dev, iters=4, warmup=1)
    assert _dev.launched == 5 and _dev.pending == 0, "warmup + iters launches, all finished"
assert len(_samples) == 4 and all(0.015 <= s < 0.3 for s in _samples)
assert len(set(_samples)) > 1, "per-iteration samples, not one average repeated"
### END HIDDEN TESTS

# %% [markdown]
# Your loop beside the two broken ones, on the same op:

# %%
with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
    pitfalls["your time_op\n(warm-up, synchronize)"] = time_op(dev, iters=ITERS, warmup=2)
timing.plot_samples(pitfalls, truth_s=OP, title=f"{ITERS} timed iterations each")
plt.show()

# %% [markdown]
# ## 5. The course harness
#
# From now on nobody writes a timing loop by hand: `timing.bench(fn)` does warm-up, the right
# clock (CUDA events with one synchronize per round on a GPU, `perf_counter` on the CPU), an L2
# flush between GPU samples, repetition of very short calls, and reports the median and
# inter-quartile range. `timing.compare(candidate, baseline)` interleaves the two, so drift
# (clock boost, thermal throttling, a noisy neighbour) hits both alike, and reports
# `median(baseline) / median(candidate)` with a bootstrap 95% confidence interval.
#
# Below: `a @ b` against an einsum that broadcasts to an $n\times n\times n$ tensor first.

# %%
n = 32 if QUICK else 512 if GPU else 96
a, b = torch.randn(n, n, device=DEV), torch.randn(n, n, device=DEV)
reps = 3 if QUICK else 20
results = {
    "a @ b": timing.bench(lambda: a @ b, reps=reps),
    "broadcast-sum vs a @ b": timing.compare(lambda: (a[:, :, None] * b[None, :, :]).sum(1), lambda: a @ b, reps=reps),
}
print(results["broadcast-sum vs a @ b"])
timing.plot(results, title=f"n = {n}")
plt.show()
timing.table(results)

# %% [markdown]
# On a GPU, the same measurement with the host clock and no synchronize (`sync=False`) shows the
# missing-sync error on real hardware:

# %%
if GPU:
    n = 4096
    a, b = torch.randn(n, n, device=DEV), torch.randn(n, n, device=DEV)
    right = timing.bench(lambda: a @ b)
    wrong = timing.bench(lambda: a @ b, sync=False)
    device.synchronize()
    print(f"events: {right}\nno sync: {wrong}  ({right.median / wrong.median:.0f}x too fast)")
else:
    print("needs a GPU: on the CPU every PyTorch op runs synchronously")

# %% [markdown]
# ## 6. MFU in practice
#
# Training a transformer with $N$ parameters costs about $6N$ FLOPs per token: $2N$ for the
# forward pass (one multiply-add per weight) and $4N$ for the backward pass (gradients with
# respect to both activations and weights). Attention adds a term that grows with context length,
# which this rule ignores.
#
# Suppose a 7-billion-parameter model trains at 3,000 tokens per second on each H100 in bf16.

# %%
achieved = 6 * 7e9 * 3000 / 1e12
h100_peak = device.PEAKS["h100"].bf16_tflops
print(f"useful compute {achieved:.0f} TFLOP/s per GPU -> MFU {mfu(achieved, h100_peak):.1%} "
      f"of the {h100_peak:g} TFLOP/s datasheet peak")
if sheet is not None:
    largest = list(points)[-1]
    print(f"{largest} in section 3: {mfu(points[largest][1], sheet.tflops):.0%} of the fp32 datasheet peak")

# %% [markdown]
# MFU counts only the model's FLOPs. Recomputed activations, padding tokens and idle time during
# communication all lower it, which is why it is the number to compare between training setups —
# and why well-tuned large runs report roughly 35–55%, not 100%.
#
# ## Summary
#
# - Two datasheet numbers, peak FLOP/s and bandwidth, and one property of a kernel, its
#   arithmetic intensity, bound how fast it can run. Small GEMMs and element-wise ops are
#   memory-bound on modern GPUs.
# - Time a GPU with a warm-up, a synchronize, and many samples; report the median and spread.
#   The course harness does all of this; use it.
# - Next, lab 01 builds a matrix multiply that climbs this roofline.
