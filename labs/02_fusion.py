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
# # Lab 02 — Fusion: compute, bandwidth and overhead
#
# Whatever a deep learning program does, its time goes to one of three things:
#
# - **compute**: the arithmetic units are busy (large matrix multiplies, lab 01);
# - **memory bandwidth**: the arithmetic units wait for data to arrive from DRAM (almost
#   everything that is not a matrix multiply: activations, normalisations, softmax);
# - **overhead**: neither is busy, because the host is still deciding what to run next (Python,
#   the framework's dispatcher, kernel launches).
#
# The remedy depends on the regime, so the first skill is telling them apart. Horace He's essay
# *Making Deep Learning Go Brrrr From First Principles* (2022) frames performance this way; this
# lab measures each regime on your machine and then removes memory traffic by **fusion**:
#
# 1. measure overhead, and the point where a chain of operations stops being limited by memory
#    and starts being limited by arithmetic; let `torch.compile` fuse a chain *(sections 1–2,
#    about 40 minutes)*;
# 2. count the bytes a softmax moves when run as five separate ops *(section 3, about 30 minutes;
#    graded: `softmax_bytes`, 2 points)*;
# 3. write a **fused softmax kernel** in Triton: one pass over memory instead of five, for any
#    row length *(section 4, about 75 minutes; graded: `softmax_fp32` 3 points, `softmax_fp16`
#    2 points, `softmax_speed` 2 points on GPU profiles)*;
# 4. fold a BatchNorm into the convolution before it, for inference *(section 5, about 35 minutes;
#    graded: `conv_bn_fold`, 3 points)*;
# 5. train through Conv → BatchNorm while keeping less memory for backward, by recomputing
#    *(section 6, about 45 minutes; graded: `convbn_memory`, 3 points)*;
# 6. see what the compiler sees: graph breaks, recompiles, CUDA graphs, and TorchScript's trace
#    against its script *(section 7, about 25 minutes)*;
# 7. measure where a small transformer's training step spends its FLOPs and where its time
#    *(section 8, about 15 minutes)*.
#
# Without a GPU, Triton kernels run in the Triton interpreter (see lab 01): correct, and far too
# slow to time. Timings on a CPU are of PyTorch's CPU kernels.
#
# **Time:** about 4.5 hours for a student who has done the labs before it, by section in minutes:
# §1 15; §2 25; §3 30; §4 75; §5 35; §6 45; §7 25; §8 15. Graded code regions take most of it; the
# estimates are the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import matplotlib.pyplot as plt
import torch

from fastdl_lab import checks, fusion, softmax, timing, triton_aot

GPU = device.has_gpu()
DEV = "cuda" if GPU else "cpu"
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. Overhead
#
# Every PyTorch op, however small, goes through Python, argument parsing, the dispatcher that
# picks a kernel for the tensor's device and dtype, an output allocation and (on a GPU) a kernel
# launch. That fixed cost is paid per op, not per element. Below: the time of one `a + b` as the
# tensors grow from a single element to millions, next to one addition of two Python floats.

# %%
probe = fusion.overhead_probe(n_ops=200, sizes=(1, 256, 1 << 16)) if QUICK else fusion.overhead_probe()
py_add = probe[0]["per_op_s"]
sizes = [r["elements"] for r in probe[1:]]
per_op = [r["per_op_s"] for r in probe[1:]]
for r in probe:
    print(f"{r['what']:>17} of {r['elements']:>9,} elements: {r['per_op_s'] * 1e6:10.3f} µs per op")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.loglog(sizes, per_op, "o-", label="torch a + b")
ax.axhline(py_add, color="grey", ls="--", label="Python float add")
ax.set_xlabel("elements per tensor")
ax.set_ylabel("seconds per op")
ax.legend()
plt.show()

# %% [markdown]
# The curve is flat on the left: a one-element add costs about as much as one with a few
# thousand elements, and far more than a Python float add. There the program is
# **overhead-bound**, and making the arithmetic faster changes nothing. Only on the right does
# the time grow with the size, which is the bandwidth-bound regime. The cures for overhead are
# bigger ops (batching), fewer ops (fusion), and taking Python out of the loop (CUDA graphs,
# `torch.compile`). On a GPU the flat part is higher still: each op also launches a kernel, a
# few microseconds during which a modern GPU could have done millions of FLOPs.

# %% [markdown]
# ## 2. Bandwidth or compute? The repeated multiply
#
# Take `x * 1.0001` and chain it `k` times. Each multiply is one FLOP per element.
#
# - **Eagerly**, every multiply is its own op: it reads the whole tensor and writes a new one, so
#   the time grows in proportion to `k`.
# - **Fused** into one kernel (here by `torch.compile`), the tensor is read once and written
#   once, and the `k` multiplies happen in registers. While memory is the limit the extra
#   multiplies are free: the time stays flat. Once `k` is large enough that arithmetic takes
#   longer than moving the data, the time rises with `k` — the kernel has become compute-bound.
#
# The value of `k` at the knee is the machine's ridge point (lab 00) in FLOPs per element moved.
# Compiling one kernel per `k` takes a while the first time (torch.compile starts its compiler).

# %%
if QUICK:  # each k is a compile, seconds apiece on a CPU; the grade needs none of them
    print("the repeated-multiply curve is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    ks = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024] if GPU else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    curve = fusion.repeated_multiply_curve(ks, n=None, reps=5,
                                           eager_max_k=256 if GPU else 64)
    for r in curve:
        eager = f"{r['eager_s'] * 1e3:8.3f} ms" if r["eager_s"] else "       -   "
        print(f"k={r['k']:5d}: eager {eager}, compiled {r['compiled_s'] * 1e3:8.3f} ms, "
              f"{r['gbs']:7.1f} GB/s, {r['flop_per_s'] / 1e9:8.1f} GFLOP/s")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    eager_rows = [r for r in curve if r["eager_s"]]
    ax1.loglog([r["k"] for r in eager_rows], [r["eager_s"] for r in eager_rows], "o-", label="eager (k ops)")
    ax1.loglog(ks, [r["compiled_s"] for r in curve], "o-", label="compiled (one fused op)")
    ax1.set_xlabel("multiplies per element (k)")
    ax1.set_ylabel("seconds")
    ax1.legend()
    ax2.semilogx(ks, [r["gbs"] for r in curve], "o-", color="tab:blue")
    ax2.set_xlabel("multiplies per element (k)")
    ax2.set_ylabel("GB/s (compiled)", color="tab:blue")
    ax2b = ax2.twinx()
    ax2b.semilogx(ks, [r["flop_per_s"] / 1e9 for r in curve], "s-", color="tab:red")
    ax2b.set_ylabel("GFLOP/s (compiled)", color="tab:red")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# Read the right-hand plot from left to right: the bandwidth stays near the machine's roof while
# the FLOP rate climbs in proportion to `k` (bandwidth-bound), then the bandwidth falls while the
# FLOP rate levels off (compute-bound). Where the knee falls is the machine's balance of
# arithmetic to bandwidth. On an H100 it is near `k` = 80: each element costs 8 bytes of traffic
# (4 read, 4 written) at 3.35 TB/s, and the 67 TFLOP/s fp32 peak counts a fused multiply-add as
# two FLOPs, so plain multiplies run at half of it.
#
# Almost every op in a network that is not a matrix multiply sits far to the left of the knee:
# an activation does a few FLOPs per element. Such ops gain nothing from faster arithmetic and
# everything from moving fewer bytes, and fusing them moves the intermediate results out of
# memory and into registers.
#
# ### torch.compile on a chain of pointwise ops
#
# `fusion.pointwise_chain` is eight pointwise ops (multiply, add, ReLU, sigmoid...). Eagerly that is
# eight passes over memory; `torch.compile` generates one loop (C++ on a CPU, a Triton kernel on
# a GPU) that does all eight per element.

# %%
if QUICK:  # a compile, seconds on a CPU, that the grade does not need
    print("the compiled chain is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    chain_x = checks.randn(1 << 26 if GPU else 1 << 22, device=DEV)
    compiled_chain = torch.compile(fusion.pointwise_chain)
    checks.assert_close(compiled_chain(chain_x), fusion.pointwise_chain(chain_x), name="compiled chain")
    cmp = timing.compare(lambda: compiled_chain(chain_x), lambda: fusion.pointwise_chain(chain_x), reps=10)
    print(f"compiled vs eager on {chain_x.numel():,} elements: {cmp}")
    timing.plot({"pointwise chain, compiled vs eager": cmp})
    plt.show()

# %% [markdown]
# ## 3. How many bytes does a softmax move?
#
# Softmax turns each row of scores into probabilities:
# $\mathrm{softmax}(x)_j = e^{x_j - m} / \sum_i e^{x_i - m}$, where $m = \max_i x_i$. Subtracting
# the row maximum changes nothing mathematically and keeps `exp` from overflowing: the largest
# exponent is then $e^0 = 1$.
#
# Written with PyTorch ops (`softmax.softmax_eager_steps`) it takes five: a row max, a subtract,
# an exp, a row sum and a divide. Each reads its inputs from memory and writes its output to
# memory, and the next op reads that output back. **Count the traffic**, in elements, for an
# `M × N` matrix (`M` rows of `N` columns). The first row of the table is done for you:
#
# | op | reads | writes |
# |---|---|---|
# | max over each row | $MN$ | $M$ (one maximum per row) |
# | subtract the row's max | ? | ? |
# | exp | ? | ? |
# | sum over each row | ? | ? |
# | divide by the row's sum | ? | ? |
#
# Look at `softmax_eager_steps` for what each op takes and returns: an op that combines the
# matrix with one value per row reads both. Then the fused kernel you write in section 4: it
# reads the matrix and writes the result, and keeps everything in between on chip.
#
# **Your task:** `softmax_bytes(n_rows, n_cols, bytes_per_elem)` returns the pair
# `(naive_bytes, fused_bytes)`: the bytes moved by the five eager ops and by a fused kernel,
# each element costing `bytes_per_elem`. The test gives you one example to check against.

# %% nbgrader={"grade_id": "softmax_bytes_code", "solution": true}
def softmax_bytes(n_rows, n_cols, bytes_per_elem):
    """(naive, fused) bytes moved by the five-op softmax and by a fused kernel."""
    ### BEGIN SOLUTION
    per_row_reads = 5 * n_cols + 2
    per_row_writes = 3 * n_cols + 2
    naive = n_rows * (per_row_reads + per_row_writes) * bytes_per_elem
    return naive, 2 * n_rows * n_cols * bytes_per_elem
    ### END SOLUTION


# %% nbgrader={"grade_id": "softmax_bytes", "grade": true, "points": 2}
_naive, _fused = softmax_bytes(2, 3, 4)
assert (_naive, _fused) == (224, 48), f"2 x 3 fp32: expected (224, 48), got {(_naive, _fused)}"
_naive, _fused = softmax_bytes(4096, 4096, 2)
print(f"softmax_bytes: visible tests passed; a 4096 x 4096 fp16 softmax moves {_naive / 2**20:.1f} MiB "
      f"in five ops, {_fused / 2**20:.1f} MiB fused ({_naive / _fused:.2f}x)")
### BEGIN HIDDEN TESTS
assert softmax_bytes(1, 1, 2) == (24, 4), softmax_bytes(1, 1, 2)
for _m, _n, _b in [(1, 1, 1), (7, 13, 4), (1000, 1, 2), (3, 4096, 2), (123, 457, 8)]:
    _got = softmax_bytes(_m, _n, _b)
    assert tuple(_got) == ((8 * _m * _n + 4 * _m) * _b, 2 * _m * _n * _b), (_m, _n, _b, _got)
assert softmax_bytes(0, 5, 4) == (0, 0)
### END HIDDEN TESTS

# %% [markdown]
# As rows get longer the ratio of your two counts tends to a constant: the per-row vectors
# (maxima, sums) stop mattering next to the matrix passes. That constant, about 4, is how much
# slower than necessary the five-op softmax is on any bandwidth-bound device. PyTorch's own `torch.softmax` is a single fused
# kernel; the CPU shows the gap too:

# %%
sm_x = checks.randn(4096, 1024, device=DEV)
cmp = timing.compare(lambda: torch.softmax(sm_x, dim=-1), lambda: softmax.softmax_eager_steps(sm_x), reps=10)
print(f"torch.softmax vs five eager ops, 4096 x 1024 fp32: {cmp.speedup:.2f}x "
      f"(95% CI {cmp.ci_low:.2f}-{cmp.ci_high:.2f})")

# %% [markdown]
# ## 4. A fused softmax kernel
#
# One Triton program per row. For a row that fits in one block the kernel is short: load the
# row, take its max, subtract, exponentiate, sum, divide, store. But rows can be longer than any
# block that fits in registers (vocabularies of 50 000 and more), and the maximum must be known
# before the first exponential is taken... or must it?
#
# **Online softmax** (Milakov and Gimelshein, *Online normalizer calculation for softmax*, 2018)
# computes the maximum $m$ and the sum $s = \sum_i e^{x_i - m}$ in one sweep over the blocks of a
# row. Keep a running max and a running sum; when a block brings a larger maximum $m'$, every
# term already in the sum was computed against the old $m$, and
# $e^{x_i - m'} = e^{x_i - m} \cdot e^{m - m'}$, so the whole sum is rescaled at once:
#
# $$ m' = \max(m, \max_{j \in \text{block}} x_j), \qquad
#    s' = s \cdot e^{m - m'} + \sum_{j \in \text{block}} e^{x_j - m'} $$
#
# A second sweep then writes $e^{x_j - m} / s$. (FlashAttention, lab 05, rests on the same
# rescaling.)
#
# Write `softmax_kernel` with exactly this signature. `softmax.softmax(x, kernel=..., block_n=...)`
# validates `x` (2-D, contiguous rows), allocates the output (NaN-filled on the CPU: a row you
# never write is caught), and launches `n_rows` programs. Row `r` of `x` starts at
# `x_ptr + r * stride_xm`, and of `y` at `y_ptr + r * stride_ym`; columns are contiguous.
#
# Your kernel must:
#
# 1. work for **any** `n_cols`, including rows longer than `BLOCK_N`, which the tests force with
#    small blocks: loop over the row in steps of `BLOCK_N`, masking columns past `n_cols`. Masked
#    loads should produce `-inf` (`other=float("-inf")`), which exp maps to 0;
# 2. compute in fp32 whatever the input type (`.to(tl.float32)` after loading) and store in the
#    output's type (`y_ptr.dtype.element_ty`);
# 3. survive large values (1e4: subtract the max before `exp`) and `-inf` entries, including a
#    whole block of them at the start of a row. While the running max is still `-inf`,
#    `-inf - (-inf)` is NaN: `tl.where` lets you subtract 0 instead. Rows made entirely of
#    `-inf` are not tested (PyTorch returns NaN for them).
#
# 4. for speed (graded on a GPU, below): when the row fits in one block (`n_cols <= BLOCK_N`, an
#    ordinary `if` on the argument), do it in one pass: load the row once, take its max,
#    exponentiate once, sum, scale and store. Keep the online sweeps for longer rows only: they
#    read the row twice and take every exponential twice. The launcher picks `BLOCK_N` as the next
#    power of two at least `n_cols`, up to 8192 for 16-bit rows on a GPU (4096 for fp32, 1024
#    under the interpreter): `softmax.default_config`.
#
# Useful: `tl.program_id(0)`, `tl.arange`, `tl.load`/`tl.store` with `mask=`, `tl.max(x, axis=0)`,
# `tl.sum(x, axis=0)`, `tl.exp`, `tl.maximum`, `tl.where`, and scalars that live across loop
# iterations, initialised with a type: `tl.full((), float("-inf"), tl.float32)` and
# `tl.zeros((), tl.float32)`.

# %% nbgrader={"grade_id": "softmax_kernel_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def softmax_kernel(x_ptr, y_ptr, n_cols, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    offs = tl.arange(0, BLOCK_N)

    if n_cols <= BLOCK_N:
        # The row fits: one read, one exp per element, one write.
        in_row = offs < n_cols
        x = tl.load(x_row + offs, mask=in_row, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + offs, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=in_row)
    else:
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            run_max = new_max

        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            in_row = cols < n_cols
            x = tl.load(x_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
            y = tl.exp(x - run_max) / run_sum
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    ### END SOLUTION


# %% nbgrader={"grade_id": "softmax_fp32", "grade": true, "points": 3}
import torch

from fastdl_lab import checks, device, softmax

_dev = "cuda" if device.has_gpu() else "cpu"


def _softmax_case(m, n, dtype, seed, block_n=None, scale=1.0, inf_fraction=0.0, inf_prefix=0):
    """Run the kernel on one seeded input and check it; -inf at random and on a row prefix."""
    x = checks.randn(m, n, seed=seed, scale=scale)
    if inf_fraction:
        drop = torch.rand(m, n, generator=checks.generator(seed + 1)) < inf_fraction
        drop[:, -1] = False  # every row keeps a finite entry
        x = x.masked_fill(drop, float("-inf"))
    x[:, :inf_prefix] = float("-inf")
    x = x.to(device=_dev, dtype=dtype)
    y = softmax.softmax(x, kernel=softmax_kernel, block_n=block_n)
    softmax.check_softmax(y, x, name=f"softmax of {m}x{n} {dtype} (block_n={block_n}, scale={scale:g})")


# One row; ragged rows in one block; rows spanning several blocks; large values and -inf.
for _m, _n, _block in [(1, 1, None), (37, 45, None), (20, 300, 32), (3, 1500, None)]:
    _softmax_case(_m, _n, torch.float32, seed=10, block_n=_block)
_softmax_case(9, 100, torch.float32, seed=11, block_n=16, scale=1e4, inf_fraction=0.2)
_softmax_case(6, 90, torch.float32, seed=12, block_n=16, inf_prefix=40)
print("softmax_fp32: visible tests passed")
### BEGIN HIDDEN TESTS
for _m, _n, _block in [(64, 128, None), (5, 17, 16), (11, 257, 64), (2, 2049, None)]:
    _softmax_case(_m, _n, torch.float32, seed=20, block_n=_block)
_softmax_case(8, 333, torch.float32, seed=21, block_n=32, scale=3e4, inf_fraction=0.5, inf_prefix=70)
_xs = checks.randn(12, 200, seed=22, device=_dev)[:, 30:170]
softmax.check_softmax(softmax.softmax(_xs, kernel=softmax_kernel, block_n=64), _xs, name="rows with a stride")
### END HIDDEN TESTS

# %% nbgrader={"grade_id": "softmax_fp16", "grade": true, "points": 2}
import torch

for _m, _n, _block in [(37, 45, None), (20, 300, 32)]:
    _softmax_case(_m, _n, torch.float16, seed=30, block_n=_block)
_softmax_case(9, 100, torch.float16, seed=31, block_n=16, scale=1e4, inf_fraction=0.2, inf_prefix=20)
print("softmax_fp16: visible tests passed (no worse than twice PyTorch's fp16 error)")
### BEGIN HIDDEN TESTS
for _m, _n, _block in [(1, 1, None), (64, 128, None), (7, 515, 128)]:
    _softmax_case(_m, _n, torch.float16, seed=40, block_n=_block)
_softmax_case(10, 250, torch.float16, seed=41, block_n=16, scale=2e4, inf_fraction=0.4, inf_prefix=33)
### END HIDDEN TESTS

# %% [markdown]
# ### What it compiles to
#
# The interpreter never produces GPU code; Triton's compiler needs no GPU to do so
# (`softmax.ptx`, as in lab 01, compiles the block and warps `softmax.softmax` launches on that
# GPU). Two things to look for: `ld.global.v4` (four values per load instruction: the row loads
# are vectorised) and `ex2.approx`, the GPU's fast base-2 exponential that `tl.exp` becomes. On
# rows of 1024 fp32 values over 4 warps each thread holds 8: a one-pass branch costs 2 vector
# loads and 8 `ex2` a thread, the online branch 4 loads and 17.

# %%
for cap in (80, 90):
    ptx = softmax.ptx(cap, torch.float32, kernel=softmax_kernel)
    summary = triton_aot.ptx_summary(ptx)
    print(f"sm_{cap} ({triton_aot.CAPABILITIES[cap]}): {summary['lines']} lines, "
          f"{ptx.count('ld.global.v4')} vector loads, {ptx.count('ex2.approx')} ex2, "
          f"{summary['global_stores']} global stores")

# %% [markdown]
# ### Speed
#
# On a GPU the last softmax item times your kernel against `torch.softmax` on a 4096 × 4096
# fp16 matrix, interleaved. A good fused kernel runs close to the memory roof: reaching
# PyTorch's speed is within reach. A row of 4096 fits one block: with the one-pass branch your
# kernel reads it from memory once and exponentiates each element once, where the two online
# sweeps read it twice (the second time mostly from the cache) and exponentiate twice. On a CPU
# the cell only reports that the item needs a GPU.

# %% nbgrader={"grade_id": "softmax_speed", "grade": true, "points": 2}
import torch

from fastdl_lab import checks, device, softmax, timing

if device.has_gpu():
    _x = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=0)
    _cmp = timing.compare(lambda: softmax.softmax(_x, kernel=softmax_kernel), lambda: torch.softmax(_x, dim=-1))
    # Read once and written once, 2 bytes per element: the traffic a fused kernel needs.
    _gbs = 2 * 4096 * 4096 * 2 / _cmp.candidate.median / 1e9
    print(f"your kernel vs torch.softmax: {_cmp.speedup:.2f}x (95% CI {_cmp.ci_low:.2f}-{_cmp.ci_high:.2f}), "
          f"{_gbs:.0f} GB/s")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## 5. Folding BatchNorm into a convolution (inference)
#
# In training, BatchNorm normalises each channel with the batch's statistics. In inference
# (`model.eval()`) it uses fixed running statistics, and becomes an affine map per output
# channel $c$:
#
# $$ \mathrm{BN}(y)_c = \gamma_c \frac{y_c - \mu_c}{\sqrt{\sigma_c^2 + \epsilon}} + \beta_c
#    = s_c\, y_c + (\beta_c - s_c \mu_c), \qquad s_c = \frac{\gamma_c}{\sqrt{\sigma_c^2 + \epsilon}} $$
#
# A convolution is linear in its weights, so scaling output channel $c$ of the weight by $s_c$
# scales that channel of the output. Conv then BN is therefore one conv with weight
# $W'_c = s_c W_c$ and bias $b'_c = s_c (b_c - \mu_c) + \beta_c$ (with $b_c = 0$ when the conv has
# no bias). One op instead of two, and one less pass over the activations. Inference
# compilers and quantisation toolkits (PyTorch's `fuse_modules`, TensorRT) do this routinely.
#
# **Your task:** `fold_conv_bn(conv, bn)` returns a new `torch.nn.Conv2d`, with a bias, equal
# to `bn(conv(x))` with `bn` in eval mode. Keep every setting of the conv (stride, padding,
# dilation, groups), handle convs with and without bias, and use `bn.eps`. When `bn.affine` is
# off, $\gamma = 1$ and $\beta = 0$. Compute the new parameters under `torch.no_grad()`; doing
# the arithmetic in float64 before copying into the new conv keeps the result within fp32
# rounding of the original pair.

# %% nbgrader={"grade_id": "fold_code", "solution": true}
import torch


def fold_conv_bn(conv, bn):
    """One Conv2d computing bn(conv(x)) for a BatchNorm2d in eval mode."""
    ### BEGIN SOLUTION
    with torch.no_grad():
        scale = 1.0 / torch.sqrt(bn.running_var.double() + bn.eps)
        gamma = bn.weight.double() if bn.affine else torch.ones_like(scale)
        beta = bn.bias.double() if bn.affine else torch.zeros_like(scale)
        scale = scale * gamma
        old_bias = conv.bias.double() if conv.bias is not None else torch.zeros_like(scale)
        folded = torch.nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size,
                                 stride=conv.stride, padding=conv.padding, dilation=conv.dilation,
                                 groups=conv.groups, bias=True, padding_mode=conv.padding_mode,
                                 dtype=conv.weight.dtype, device=conv.weight.device)
        folded.weight.copy_(conv.weight.double() * scale[:, None, None, None])
        folded.bias.copy_((old_bias - bn.running_mean.double()) * scale + beta)
    return folded
    ### END SOLUTION


# %% nbgrader={"grade_id": "conv_bn_fold", "grade": true, "points": 3}
import torch

from fastdl_lab import checks


def _fold_case(in_ch, out_ch, kernel, seed, bias, affine=True, **conv_kw):
    """A conv and a BatchNorm with seeded non-trivial statistics; folded must equal the pair."""
    torch.manual_seed(seed)
    conv = torch.nn.Conv2d(in_ch, out_ch, kernel, bias=bias, **conv_kw)
    bn = torch.nn.BatchNorm2d(out_ch, eps=1e-3, affine=affine)
    bn.running_mean.normal_(0.0, 0.3)
    bn.running_var.uniform_(0.2, 2.0)
    if affine:
        torch.nn.init.uniform_(bn.weight, 0.5, 1.5)
        torch.nn.init.normal_(bn.bias, 0.0, 0.2)
    conv.eval(), bn.eval()
    x = checks.randn(2, in_ch, 11, 13, seed=seed)
    folded = fold_conv_bn(conv, bn)
    assert isinstance(folded, torch.nn.Conv2d) and folded.bias is not None, "return a Conv2d with a bias"
    with torch.inference_mode():
        checks.assert_close(folded(x), bn(conv(x)), atol=1e-5, rtol=1e-4,
                            name=f"folded conv (bias={bias}, {conv_kw})")


_fold_case(3, 8, 3, seed=1, bias=False, padding=1)
_fold_case(3, 8, 3, seed=2, bias=True, padding=1)
_fold_case(4, 6, 1, seed=3, bias=True)
print("conv_bn_fold: visible tests passed")
### BEGIN HIDDEN TESTS
_fold_case(6, 10, 3, seed=4, bias=True, stride=2, padding=0)
_fold_case(4, 8, 5, seed=5, bias=False, stride=(1, 2), padding=2, dilation=1)
_fold_case(4, 8, 3, seed=6, bias=True, padding=2, dilation=2, groups=2)
_fold_case(5, 7, 3, seed=7, bias=False, padding=1, affine=False)
### END HIDDEN TESTS

# %% [markdown]
# Now the whole of `fusion.small_cnn()` (three Conv → BN → ReLU blocks and a classifier):
# `fusion.fold_model(model, fold=fold_conv_bn)` copies the model and replaces each pair with
# your folded conv and an `Identity`. Same outputs, fewer ops:

# %%
cnn = fusion.small_cnn().to(DEV)
folded_cnn = fusion.fold_model(cnn, fold=fold_conv_bn)
images = checks.randn(4 if QUICK else 256 if GPU else 32, 3, 32, 32, device=DEV, seed=3)
with torch.inference_mode():
    gap = (folded_cnn(images) - cnn(images)).abs().max().item()
    cmp = timing.compare(lambda: folded_cnn(images), lambda: cnn(images), reps=3 if QUICK else 10)
n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in cnn.modules())
n_bn_left = sum(isinstance(m, torch.nn.BatchNorm2d) for m in folded_cnn.modules())
print(f"BatchNorm layers: {n_bn} -> {n_bn_left}; max |folded - original| = {gap:.2e}")
print(f"folded vs original, batch of {images.shape[0]}: {cmp.speedup:.2f}x "
      f"(95% CI {cmp.ci_low:.2f}-{cmp.ci_high:.2f})")

# %% [markdown]
# The gain is the BatchNorm passes over the activations, which are bandwidth-bound: modest
# next to the convolutions on a CPU, larger where the convolutions run on tensor cores.
#
# ## 6. Conv → BatchNorm in training, with less memory
#
# In training the memory for activations often limits the batch size. Autograd keeps, until
# backward, every tensor a backward formula will need. For Conv → BN:
#
# - the conv keeps its input `x` (to compute the weight gradient) and its weight;
# - BN keeps **its** input, which is the conv's output `y`, plus its weight and two numbers per
#   channel (the batch mean and inverse standard deviation).
#
# `y` is usually the largest of these (here it has twice the channels of `x`). But `y` can be
# recomputed from `x`, which is kept anyway: a custom `torch.autograd.Function` that saves only
# `x`, the weights and the per-channel statistics, and runs the convolution again in backward,
# trades one extra convolution for the memory of `y`. This is *recomputation* (or
# rematerialisation), the idea behind activation checkpointing, applied to one pair of layers.
#
# **Your task:** `conv_bn_train(x, conv_weight, bn_weight, bn_bias, eps=1e-5, stride=1, padding=1)`
# with the same outputs and gradients as `fusion.conv_bn_train_ref` (conv without bias, then
# `F.batch_norm` with batch statistics), through your own autograd Function that keeps the
# convolution's output out of what waits for the backward (the test cell below asks for at most
# 60% of the bytes the reference saves, as `fusion.saved_tensor_bytes` counts them). What you need
# for backward, with $\hat y = (y - \mu)\,\sigma^{-1}$ (biased variance, as BatchNorm normalises
# with), out $= \gamma \hat y + \beta$, upstream gradient $g$, and means over batch and pixels
# ($n$ values per channel):
#
# $$ \frac{\partial L}{\partial \beta} = \sum g, \qquad \frac{\partial L}{\partial \gamma} = \sum g \hat y, \qquad
#    \frac{\partial L}{\partial y} = \frac{\gamma}{\sigma}\Big(g - \frac{1}{n}\frac{\partial L}{\partial \beta}
#    - \hat y \frac{1}{n}\frac{\partial L}{\partial \gamma}\Big) $$
#
# and the conv's gradients from $\partial L / \partial y$ with `torch.nn.grad.conv2d_input` and
# `torch.nn.grad.conv2d_weight`. Return `None` for the non-tensor arguments.
#
# How the grader scores it: it takes only `ConvBNRecompute` and `conv_bn_train` out of this cell
# and runs them with `torch` and `F` as their only names: no imports inside them, no
# `getattr`/`eval`, no `_private` attributes of other objects, no assignments to attributes of
# anything but `self` and `ctx`. Anything else the cell does at its top level does not reach it.
# It checks outputs and gradients on small hidden cases (3x3, strides, padding) and on a chain of
# 50 ConvBN layers (1x1 convolutions, 4 MiB activations), one forward and one backward. The memory
# points rest on that chain's **peak memory**, measured by the operating system for the whole
# process your code runs in (its memory cgroup), against the same chain run with the course's
# recompute: yours may be at most 64 MiB higher. A single layer would not show the difference (its
# forward holds `x`, `y` and the output at once either way), but by the end of the chain's forward,
# keeping every `y` costs 200 MiB. Where `y` is kept does not matter (`save_for_backward`, `ctx`, a
# list, a NumPy array): it is memory the process holds. The saved bytes your process counts
# itself are only a hint in the grader's reason.

# %% nbgrader={"grade_id": "convbn_code", "solution": true}
import torch
import torch.nn.functional as F


class ConvBNRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, conv_weight, bn_weight, bn_bias, eps, stride, padding):
        ### BEGIN SOLUTION
        conv_out = F.conv2d(x, conv_weight, None, stride, padding)
        mu = conv_out.mean(dim=(0, 2, 3), keepdim=True)
        inv_sigma = torch.rsqrt(conv_out.var(dim=(0, 2, 3), unbiased=False, keepdim=True) + eps)
        ctx.save_for_backward(x, conv_weight, bn_weight, mu, inv_sigma)
        ctx.stride, ctx.padding = stride, padding
        return (conv_out - mu) * inv_sigma * bn_weight[:, None, None] + bn_bias[:, None, None]
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        ### BEGIN SOLUTION
        x, conv_weight, bn_weight, mu, inv_sigma = ctx.saved_tensors
        conv_out = F.conv2d(x, conv_weight, None, ctx.stride, ctx.padding)
        y_hat = (conv_out - mu) * inv_sigma
        n = conv_out.numel() / conv_out.shape[1]
        d_beta = grad_out.sum(dim=(0, 2, 3))
        d_gamma = (grad_out * y_hat).sum(dim=(0, 2, 3))
        d_y = bn_weight[:, None, None] * inv_sigma * (
            grad_out - d_beta[:, None, None] / n - y_hat * d_gamma[:, None, None] / n)
        d_x = torch.nn.grad.conv2d_input(x.shape, conv_weight, d_y, ctx.stride, ctx.padding)
        d_w = torch.nn.grad.conv2d_weight(x, conv_weight.shape, d_y, ctx.stride, ctx.padding)
        return d_x, d_w, d_gamma, d_beta, None, None, None
        ### END SOLUTION


def conv_bn_train(x, conv_weight, bn_weight, bn_bias, eps=1e-5, stride=1, padding=1):
    return ConvBNRecompute.apply(x, conv_weight, bn_weight, bn_bias, eps, stride, padding)


# %% nbgrader={"grade_id": "convbn_memory", "grade": true, "points": 3}
import torch

from fastdl_lab import checks, fusion


def _convbn_case(shape, out_ch, seed, stride=1, padding=1, eps=1e-5):
    """Outputs and all four gradients against the reference, and the saved-bytes ratio."""
    batch, in_ch, size = shape[0], shape[1], shape[2]
    args = fusion.convbn_operands(batch, in_ch, out_ch, size, seed=seed)
    outs = []
    for fn in (fusion.conv_bn_train_ref, conv_bn_train):
        out = fn(*args, eps=eps, stride=stride, padding=padding)
        upstream = checks.randn(out.shape, seed=seed + 9)
        outs.append([out, *torch.autograd.grad(out, args, upstream)])
    for what, got, want in zip(["output", "grad x", "grad conv_weight", "grad bn_weight", "grad bn_bias"],
                               outs[1], outs[0]):
        checks.assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"{what} ({shape}, stride={stride})")
    ref_bytes = fusion.saved_tensor_bytes(lambda *a: fusion.conv_bn_train_ref(*a, eps, stride, padding), *args)
    new_bytes = fusion.saved_tensor_bytes(lambda *a: conv_bn_train(*a, eps, stride, padding), *args)
    assert new_bytes <= 0.6 * ref_bytes, f"saved {new_bytes:,} bytes, the reference {ref_bytes:,}: need <= 60%"
    return new_bytes / ref_bytes


_ratio = _convbn_case((8, 16, 32, 32), 32, seed=1)
print(f"convbn_memory: visible tests passed; you keep {_ratio:.0%} of the reference's saved bytes")
### BEGIN HIDDEN TESTS
_convbn_case((4, 8, 20, 20), 48, seed=2, stride=2, padding=1)
_convbn_case((3, 6, 17, 17), 16, seed=3, stride=1, padding=0, eps=1e-3)
_convbn_case((2, 16, 15, 15), 48, seed=4, stride=1, padding=0)
### END HIDDEN TESTS

# %% [markdown]
# The saving grows with depth. Below, a stack of Conv → BN → ReLU blocks of 32 channels. With
# the reference, each block keeps its input (shared with the ReLU before it, which keeps its
# output: one tensor, counted once) and the conv's output; with recomputation only the first.
# `fusion.saved_tensor_bytes` counts each storage once, which is how memory is really used.
# On a GPU the peak memory of a forward and backward pass is measured too.

# %%
def stack(block, depth):
    def run(x, w, gamma, beta):
        for _ in range(depth):
            x = torch.relu(block(x, w, gamma, beta))
        return x
    return run


stack_args = fusion.convbn_operands(8, 32, 32, 32, seed=5, dev=DEV)
depths = [1, 2, 4, 8]
saved = {name: [fusion.saved_tensor_bytes(stack(fn, d), *stack_args) / 2**20 for d in depths]
         for name, fn in [("Conv -> BN (reference)", fusion.conv_bn_train_ref), ("recompute (yours)", conv_bn_train)]}
for name, mib in saved.items():
    print(f"{name:>24}: " + ", ".join(f"{m:.1f} MiB" for m in mib) + f"  (depth {depths})")
    if GPU:
        peak = fusion.peak_memory_bytes(stack(fusion.conv_bn_train_ref if "reference" in name else conv_bn_train, 8),
                                        *stack_args)
        print(f"{'':>24}  peak over forward and backward at depth 8: {peak / 2**20:.1f} MiB")
if not GPU:
    print("peak memory: needs a GPU (the CPU allocator keeps no peak statistics)")
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for name, mib in saved.items():
    ax.plot(depths, mib, "o-", label=name)
ax.set_xlabel("Conv -> BN -> ReLU blocks")
ax.set_ylabel("MiB saved for backward")
ax.legend()
plt.show()

# %% [markdown]
# ## 7. What the compiler sees
#
# `torch.compile` does not read your function's source. Its front end, **Dynamo**, runs the
# function's Python bytecode symbolically and records every tensor operation into a graph, which
# the back end (Inductor) turns into fused kernels as in section 2. Two things interrupt it:
#
# - a **graph break**: an instruction a graph cannot hold. The classic one is a branch on a
#   tensor's *values*, `if y.sum() > 0:` — which way it goes is unknown until the tensor exists.
#   Dynamo ends the graph before the branch, lets Python run it, and starts a new graph after.
#   Each break costs a return to Python and cuts fusion across it;
# - a **recompile**: every graph is guarded by what Dynamo assumed while recording (shapes,
#   dtypes, devices, and the *values* of plain Python numbers, which become constants). A call
#   that breaks a guard compiles a new version.
#
# `torch._dynamo.explain` runs Dynamo only and reports what it found. `compiler.data_dependent`
# computes `sin(x) * scale`, then takes `cos` or `exp` depending on the sign of its sum:

# %%
import inspect

from fastdl_lab import compiler

print(inspect.getsource(compiler.data_dependent))
found = compiler.graph_breaks(compiler.data_dependent, torch.randn(8))
print(f"{found.graphs} graphs, {found.breaks} graph break(s):")
for reason in found.reasons:
    print("  ", reason)
assert found.breaks == 1 and found.graphs == 2

# %% [markdown]
# In a real program, ask torch to say what happens while it runs: the environment variable
# `TORCH_LOGS=graph_breaks,recompiles` (read when torch starts, so here in a fresh Python) logs
# every break with its reason and every recompile with the guard that failed. The script below
# compiles `data_dependent` and calls it three times: as it is, with `scale=3.0` instead of `2.0`,
# and with float64 input. Only the headlines are printed; the full messages also carry hints and
# the user's stack.

# %%
print(compiler.LOG_DEMO)
if QUICK:  # a fresh Python with torch and Dynamo: 10-15 s on a CPU
    print("left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    headlines = ("Graph break in user code", "Graph Break Reason", "Recompiling function", "triggered by")
    for line in compiler.torch_logs():
        if any(h in line for h in headlines) or (" - " in line and ("==" in line or "mismatch" in line)):
            print(line)

# %% [markdown]
# `explain` names the break tersely (`generic_jump TensorVariable()`: a jump, the `if`, that
# depends on a tensor) and the logs spell it out. In the logs, `[0/1]` is frame 0's second
# compile; `torch_dynamo_resume_in_data_dependent_at_…` is the code after the break, compiled as a
# frame of its own. Read the recompiles: `scale == 2.0` was a guard, so `3.0` compiled the
# function again (a number that changes every call should be a tensor), and float64 input failed
# the dtype guard. Each recompile costs a compile, and after
# `torch._dynamo.config.recompile_limit` of them (8 by default) Dynamo stops compiling the
# function and runs it eagerly. The data-dependent break is
# fundamental: make the code branchless (compute both sides and `torch.where`), or express the
# branch with `torch.cond`, which puts both branches in the graph.
#
# ### CUDA graphs: `mode="reduce-overhead"`
#
# Section 1's flat curve is overhead: per op the host pays Python, the dispatcher and a kernel
# launch. Fusion removes the ops it can merge; a **CUDA graph** removes the launches of the rest.
# The GPU records a whole sequence of kernels once, and from then on the host replays it with one
# call. `torch.compile(fn, mode="reduce-overhead")` does this for each compiled graph: it records
# after a few warm-up calls and replays afterwards, with inputs copied into the recorded
# addresses. The gain is largest where section 1 says the time goes to launches: many small
# kernels, such as `compiler.tiny_layers`, a stack of 32 linear layers of 64 × 64 on a batch of 8.
# A CUDA graph is a GPU object: there is nothing to record on a CPU.

# %%
if GPU:
    results = compiler.reduce_overhead_timings()
    for name, t in results.items():
        print(f"{name:>16}: {t}")
    print(f"reduce-overhead vs eager: {results['eager'].median / results['reduce-overhead'].median:.1f}x")
else:
    print("needs a GPU: mode='reduce-overhead' records and replays CUDA graphs")

# %% [markdown]
# ### TorchScript: tracing vs scripting
#
# Before `torch.compile`, PyTorch's way to get a graph out of Python was **TorchScript**, which
# you will still meet in older code and deployment recipes. It has two entry points that disagree
# exactly where Dynamo breaks the graph:
#
# - `torch.jit.trace(fn, example)` runs `fn` once on `example` and records the operations that ran.
#   A branch is not an operation: the side the example took is recorded, the other is lost;
# - `torch.jit.script(fn)` compiles the source, in a subset of Python, and keeps the `if`.
#
# `compiler.sign_scale` returns `2x` when `x` sums to more than 0 and `-x` otherwise. Traced on a
# positive example and called on a negative one:

# %%
probe = compiler.trace_vs_script(compiler.sign_scale, example=torch.ones(4), other=-torch.arange(1.0, 5.0))
for name, out in probe["outputs"].items():
    print(f"{name:>9}: {out.tolist()}")
print("traced code:\n" + probe["traced_code"])
print("scripted code:\n" + probe["scripted_code"])
print("warnings when tracing:", *probe["warnings"]["trace"], sep="\n  ")
print("warnings when calling:", probe["warnings"]["calls"])
assert torch.equal(probe["outputs"]["scripted"], probe["outputs"]["eager"])
assert not torch.equal(probe["outputs"]["traced"], probe["outputs"]["eager"])

# %% [markdown]
# The trace froze the branch into `x * 2`: called on a negative input it returns the wrong answer,
# and says nothing when it does; the only sign was a `TracerWarning` once, at trace time. The
# script kept both sides. PyTorch's documentation marks TorchScript as deprecated (both calls
# warn so above) and points to `torch.compile` for speed and `torch.export` for a whole-program
# graph to deploy. `torch.export` refuses a data-dependent branch with an error instead of
# guessing, and takes `torch.cond` for one.

# %% [markdown]
# ## 8. Where a transformer's time goes: FLOPs against time
#
# The three regimes meet in one model. In BERT the matrix multiplies are 99.8% of the FLOPs but
# only about 61% of the time (Ivanov et al., *Data Movement Is All You Need*, MLSys 2021): the rest
# goes to softmax, normalisation, the elementwise ops and copies, which do almost no arithmetic
# and are bound by memory (or by overhead, at small sizes). `breakdown.flop_time_table` measures
# the split for a training step (forward and backward) of a small GPT, the model of the capstone
# lab 10, with its attention written out so that every matmul is an op of its own: FLOPs per op
# from `FlopCounterMode`, each op's own time from `torch.profiler`, both grouped by op class.

# %%
if QUICK:  # the profiler's start-up alone is seconds per graded run, and the grade needs none of it
    print("the FLOPs-against-time table is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    from fastdl_lab.capstone import breakdown, model as gpt_model

    config = gpt_model.CPU_CONFIG
    gpt = gpt_model.build(config, attention="math", device=DEV)
    # Any tokens do: the FLOPs and the time of a step do not depend on which bytes it reads.
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(DEV)
    shares = breakdown.flop_time_table(breakdown.training_step(gpt, tokens, tokens.roll(-1, 1)), steps=5)
    for r in shares:
        print(f"{r['class']:>12}: {r['flops_share']:6.1%} of the FLOPs, {r['time_share']:6.1%} of the time "
              f"({r['time_s'] * 1e3:.1f} ms per step)")
    breakdown.plot_shares(shares, title=f"GPT d={config.d_model}, {config.n_layer} blocks, batch 8, on {DEV}");

# %% [markdown]
# On the 2-core course machine (d = 128, 4 blocks, 128 tokens, batch 8;
# `benchmarks/results/experiments.csv`) the matmuls did all the counted FLOPs in 51% of the time;
# the elementwise ops and copies took 31%, softmax 6%, LayerNorm 3% and the rest (the embedding,
# the loss's bookkeeping) 9%. Every non-matmul op is a candidate for fusion: the fused softmax of
# section 4, a fused LayerNorm (lab 03), attention that never writes its scores (lab 05), and what
# `torch.compile` fuses on its own.

# %% [markdown]
# ## Summary
#
# - Three regimes: **overhead** (time per op flat in the size: batch, fuse, leave Python),
#   **bandwidth** (time proportional to bytes: move fewer of them), **compute** (time
#   proportional to FLOPs: use tensor cores, lower precision). Measure before optimising.
# - Fusion turns several memory-bound passes into one. The repeated multiply shows how far it
#   goes: extra arithmetic is free until the kernel reaches the ridge point.
# - Softmax done in five ops moves about four times the bytes it needs. A fused kernel reads
#   the row once; the online softmax makes that true for any row length.
# - Some fusions are exact rewrites of the model: BatchNorm folds into the conv before it at
#   inference. Others trade work for memory: recomputing the conv output in backward saves
#   the largest tensor Conv → BN would keep.
# - The compiler sees bytecode, not source: a branch on a tensor's values breaks the graph, a new
#   shape, dtype or Python number recompiles it (`torch._dynamo.explain`, `TORCH_LOGS`). CUDA
#   graphs (`mode="reduce-overhead"`) replay a GPU's launches in one call. A trace silently keeps
#   the branch its example took.
# - In a transformer the matmuls are nearly all the FLOPs but far from all the time: the rest
#   is memory-bound ops, the targets of fusion.
