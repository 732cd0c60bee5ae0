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
# # Lab 01 — GEMM: from Python loops to a tiled Triton kernel
#
# General matrix multiply (GEMM) is where almost all of a neural network's arithmetic happens:
# linear layers, attention projections, convolutions lowered to matrices. It is also the one
# operation that can reach a GPU's compute roof, because it does $O(n^3)$ work on $O(n^2)$ data.
# In this lab you will:
#
# 1. see where the famous "100× faster on a GPU" figures came from, then climb from three Python
#    loops to a BLAS library and see how far apart they are *(sections 1–2, about 30 minutes)*;
# 2. learn how a GPU runs a kernel (SMs, warps, programs, the memory hierarchy, coalescing), read
#    a first kernel (a scaled add: which program owns which elements, and the mask), and write a
#    small one: a **row sum** *(sections 3–4, about 75 minutes; graded: `row_sum`, 2 points)*;
# 3. write a **tiled Triton matmul kernel** *(section 5, about 75 minutes; graded: `matmul_fp32`
#    4 points, `matmul_fp16` 2 points)*;
# 4. implement the **grouped launch order** that makes tiles share the L2 cache *(section 7, about
#    40 minutes; graded: `grouped_order`, 2 points)*;
# 5. meet tensor cores and TF32, place every version on the roofline, and compile your kernel
#    for real GPUs even if you do not have one *(sections 6, 8 and 9, about 60 minutes)*;
# 6. tune tiles, `num_warps` and `num_stages` from what the compiler reports, and on a GPU by
#    timing *(sections 10–11, about 40 minutes; graded: `matmul_speed`, 2 points on GPU
#    profiles)*;
# 7. lower a convolution to one GEMM (im2col), check it against `F.conv2d`, and see what the
#    copies cost *(section 12, about 20 minutes)*;
# 8. see how a matrix multiply ran on a GPU before CUDA, as render passes of a fragment shader,
#    and what on-chip sharing changed *(section 13, about 15 minutes)*.
#
# Without a GPU, Triton kernels run in the **Triton interpreter** (`TRITON_INTERPRET=1`, switched
# on by `fastdl_lab.device`): the same source, executed with NumPy on the CPU. It is exact enough
# to test correctness, and far too slow to say anything about speed.
#
# **Time:** about 6 hours for a student who has done the labs before it, by section in minutes: §1
# 15; §2 15; §3 30; §4 45; §5 75; §6 15; §7 40; §8 30; §9 15; §10 30; §11 10; §12 20; §13 15.
# Graded code regions take most of it; the estimates are the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from fastdl_lab import checks, gemm, measure, rowsum, simt, timing, triton_aot

GPU = device.has_gpu()
DEV = "cuda" if GPU else "cpu"
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. A cautionary tale: "100× faster on the GPU"
#
# Around 2009, papers regularly reported GPU speedups of 10× to over 100× against CPUs. In 2010
# a team at Intel (Lee et al., *Debunking the 100X GPU vs. CPU Myth*, ISCA 2010) re-ran 14
# throughput kernels on an NVIDIA GTX 280 and an Intel Core i7-960 with both sides carefully
# optimised, and measured the GPU at about **2.5× faster on average**.
#
# Where did the big figures come from? Put the two chips' datasheet roofs side by side, the way
# lab 00 taught. The GTX 280 (2008) had 240 simple cores at 1.3 GHz, each able to issue a fused
# multiply-add (2 FLOPs) per cycle, plus a multiply on a separate unit that only some code
# could use; its memory moved 141.7 GB/s. The Core i7-960 (2009) had 4 cores at 3.2 GHz, each
# able to issue a 4-wide SSE add and a 4-wide SSE multiply per cycle (8 FLOPs), and three
# channels of DDR3 at 25.6 GB/s.

# %%
gtx280_fma = 240 * 1.296 * 2  # GFLOP/s: cores x GHz x FLOPs per cycle (multiply-add)
gtx280_peak = 240 * 1.296 * 3  # counting the extra multiply, as the datasheet did
i7_peak = 4 * 3.2 * 8  # 4 cores x 3.2 GHz x (4-wide add + 4-wide multiply)
i7_one_scalar_core = 1 * 3.2 * 2  # one thread, no SSE: one add and one multiply per cycle
print(f"compute roofs:   GTX 280 {gtx280_fma:.0f}-{gtx280_peak:.0f} GFLOP/s, Core i7 {i7_peak:.1f} GFLOP/s "
      f"-> {gtx280_fma / i7_peak:.1f}-{gtx280_peak / i7_peak:.1f}x")
print(f"bandwidth roofs: GTX 280 141.7 GB/s, Core i7 25.6 GB/s -> {141.7 / 25.6:.1f}x")
print(f"against one thread of scalar code: {gtx280_fma / i7_one_scalar_core:.0f}-"
      f"{gtx280_peak / i7_one_scalar_core:.0f}x")

# %% [markdown]
# Tuned code on both sides can at best approach the ratio of the roofs: about 6–9× for
# compute-bound kernels, about 5.5× for memory-bound ones, and less where the GPU's simple cores
# cope badly with branches or irregular access, hence Intel's 2.5× on average. A tuned GPU kernel
# compared with a single CPU thread that uses no SIMD instructions, the usual baseline of the
# day, starts with a 16× handicap for the CPU (4 cores idle, 4 SIMD lanes idle): 100–150× follows
# from the datasheets alone, before any difference in the care spent on the two programs. Some
# reports also left out the copies between host and GPU memory, or compared against an older CPU.
#
# The lesson for this course: a speedup is only meaningful against a competent baseline, in the
# same precision, measured the same way. Our baseline is always a tuned library (`torch.matmul`,
# which calls cuBLAS on a GPU and a vendor BLAS on a CPU). Once both sides are tuned, the ratio
# of two machines tends towards the ratio of their roofs.

# %% [markdown]
# ## 2. Loops, then BLAS
#
# The textbook definition $C_{ij} = \sum_p A_{ip} B_{pj}$ as three Python loops
# (`gemm.matmul_loops`) is correct and hopeless: every multiply-add is several interpreted
# bytecodes. A BLAS library (`numpy`'s `@`, `torch.matmul` on the CPU) uses SIMD registers,
# all cores, and blocking for the caches. Same FLOPs, very different rates:

# %%
def gflops(n, t):
    return 2 * n**3 / t.median / 1e9


rates = {}
for n in (16, 48) if QUICK else (16, 32, 48):
    a, b = torch.randn(n, n), torch.randn(n, n)
    rates[f"loops n={n}"] = gflops(n, timing.bench(lambda: gemm.matmul_loops(a, b), warmup=1, reps=1 if QUICK else 3))
# One library at a time (see the note below the output).
for library, fn in (("torch", torch.matmul), ("numpy", gemm.matmul_numpy)):
    for n in (48, 128) if QUICK else (48, 256, 512):
        a, b = torch.randn(n, n), torch.randn(n, n)
        rates[f"{library} n={n}"] = gflops(n, timing.bench(lambda: fn(a, b), warmup=2 if QUICK else 5,
                                                           reps=3 if QUICK else 10))
for name, rate in rates.items():
    print(f"{name:>14}: {rate:10.3f} GFLOP/s")
print(f"BLAS / loops at n=48: {rates['torch n=48'] / rates['loops n=48']:,.0f}x")

# %% [markdown]
# Note that NumPy and PyTorch are each timed on their own here. Interleaving their calls on a
# small machine makes both libraries' worker threads (OpenBLAS's and OpenMP's, which spin while
# waiting for work) compete for the same cores, and can slow the small products by orders of
# magnitude — a measurement artefact worth recognising.

# %% [markdown]
# ## 3. How a GPU runs a kernel
#
# Before writing a kernel, the machine it runs on.
#
# **Streaming multiprocessors and SIMT.** An NVIDIA GPU is built from **streaming
# multiprocessors (SMs)**: 40 on a T4, 108 on an A100, 132 on an H100. Each SM is a processor of
# its own, with its registers, its on-chip memory and four instruction schedulers. Threads are
# handled in **warps** of 32: a scheduler issues one instruction for all 32 threads of a warp at
# once, and each thread applies it to its own data (*single instruction, multiple threads*,
# SIMT). When threads of a warp disagree at a branch, the warp runs both sides one after the
# other with the threads of the other side switched off, which is why branchy code is slow on a
# GPU. An SM keeps dozens of warps resident (up to 64 on an A100 or H100) and picks a ready one
# every cycle: while some warps wait hundreds of cycles for memory, others compute. A GPU hides
# memory latency with many independent warps, where a CPU core uses large caches and
# speculation.
#
# **Blocks, and what a Triton program is.** A CUDA kernel is launched as a grid of **thread
# blocks**. A block runs on one SM from start to end; its threads share that SM's on-chip memory
# and can synchronise with each other, threads of different blocks cannot. A Triton **program**
# is one such block. `kernel[grid](...)` launches `grid` programs, `tl.program_id(0)` tells each
# program which one it is, and the launch option `num_warps` (4 unless you say otherwise) sets
# its size: 32 × `num_warps` threads. You never address threads in Triton. You write operations
# on whole blocks of values (`tl.arange(0, 512)` is a block of 512 offsets) and the compiler
# spreads each block over the program's threads: 512 fp32 values at 4 warps are 4 values in the
# registers of each of 128 threads. That is why block sizes are `tl.constexpr`, compile-time
# constants, and powers of two: the compiler lays the block out over threads and registers when
# it compiles, and each new value compiles a new version of the kernel.
#
# **The memory hierarchy.** Each level down is larger, further from the arithmetic, and slower
# (sizes for an H100):
#
# | level | where | size | in a Triton kernel |
# |---|---|---|---|
# | registers | private to each thread | 256 KB per SM | the blocks you compute with, such as an accumulator |
# | shared memory (with L1) | in the SM, shared by one program's warps | up to 228 KB per SM | operands of `tl.dot`, staged there by the compiler |
# | L2 cache | one per GPU, shared by every SM | 50 MB | tiles that several programs read (section 7) |
# | HBM (DRAM) | beside the chip | 80 GB at 3.35 TB/s | your tensors; every `tl.load` starts here |
#
# How many programs share an SM at once (its **occupancy**) depends on what one program needs:
# its registers (per thread, times its threads) and its shared memory must fit beside the
# others'. Section 10 reads those figures from the compiler.
#
# **Coalescing.** Data moves from memory to an SM in 32-byte sectors, and the loads of a warp's 32
# threads are served together. When the 32 threads read 32 neighbouring fp32 values (128 bytes),
# the warp costs 4 sectors and every byte moved is used: the load is **coalesced**. When they
# read every 8th value or further apart, as when walking down a column of a row-major matrix,
# each thread pays for a sector of its own: 32 sectors for the same 128 useful bytes, an eighth
# of the bandwidth. The rule for Triton kernels: let the dimension of a block that varies
# fastest be the one with stride 1 in memory.

# %%
sm_table = pd.DataFrame(
    [{"GPU": g.name, "SMs": g.sms, "warps per SM": g.max_warps_per_sm, "programs per SM (max)": g.max_programs_per_sm,
      "shared memory per SM (KiB)": g.shared_bytes_per_sm >> 10, "registers per SM": simt.REGISTERS_PER_SM,
      "L2 (MiB)": g.l2_bytes >> 20} for g in simt.GPUS.values()]).set_index("GPU")
sm_table

# %%
strides = [1, 2, 4, 8, 16, 32]
fig, ax = plt.subplots(figsize=(6, 3))
for elem_bytes, label in ((4, "fp32"), (2, "fp16")):
    ax.plot(strides, [simt.load_efficiency(s, elem_bytes) for s in strides], "o-", label=label)
ax.set_xscale("log", base=2)
ax.set_xlabel("stride between the elements of neighbouring threads (elements)")
ax.set_ylabel("bytes used / bytes moved")
ax.set_title("One warp's load: 32-byte sectors moved for 32 elements", fontsize=10)
ax.legend()
plt.show()
print("sectors per warp load, fp32:", {s: simt.warp_sectors(s, 4) for s in strides})

# %% [markdown]
# ## 4. First kernels: a scaled add, then row sums
#
# ### One dimension: `out = alpha * x + y`
#
# The smallest kernel worth writing scales one vector and adds another. Every element is
# independent, so the whole design is a single decision: which program computes which elements.
# The launcher asks for a **grid** of `cdiv(n, BLOCK)` programs; program `pid` computes the
# offsets `pid * BLOCK + tl.arange(0, BLOCK)`, `BLOCK` consecutive elements. `BLOCK` is a
# power of two and `n` is whatever the tensor's length is, so the last program's offsets usually
# run past the end. Every load and store therefore takes a **mask**, `offs < n`: where it is
# false the load reads nothing (it gives `other`, or an undefined value if none is given, which
# is harmless here because the store is masked the same way) and the store writes nothing.

# %%
import triton
import triton.language as tl

from fastdl_lab import bounds, scaled_add


@triton.jit
def scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # the elements this program owns
    inside = offs < n  # all true except past the end, in the last program
    x = tl.load(x_ptr + offs, mask=inside)
    y = tl.load(y_ptr + offs, mask=inside)
    out = alpha * x.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


x, y = checks.randn(1000, seed=1, device=DEV), checks.randn(1000, seed=2, device=DEV)
checks.assert_close(scaled_add.scaled_add(x, y, 0.5, kernel=scaled_add_kernel, block=256),
                    scaled_add.scaled_add_ref(x, y, 0.5), name="scaled add")
print(f"n=1000, BLOCK=256: {triton.cdiv(1000, 256)} programs; result matches the float64 reference")

# %% [markdown]
# Who owns what, for `n = 20` and `BLOCK = 8`: three programs, one row each. Each program's
# lanes hold consecutive offsets; the last program computes offsets 16 to 23, and its mask keeps
# 16 to 19 and drops the four past the end.

# %%
own = scaled_add.ownership(20, 8)
fig, ax = plt.subplots(figsize=(6, 1.8))
ax.imshow(own.kept, cmap="Blues", vmin=-0.5, vmax=2.5, aspect="auto")  # pale: masked, light: kept
for (p, lane), offset in np.ndenumerate(own.offsets):
    ax.text(lane, p, offset if own.kept[p, lane] else f"{offset}\nmasked", ha="center", va="center", fontsize=7)
ax.set_xticks(range(own.block), [f"lane {i}" for i in range(own.block)], fontsize=7)
ax.set_yticks(range(own.programs), [f"pid {p}" for p in range(own.programs)], fontsize=7)
ax.set_title(f"n={own.n}, BLOCK={own.block}: {own.programs} programs, {own.dropped} offsets masked off", fontsize=9)
plt.show()

# %% [markdown]
# Take the mask away and the last program reads and writes four elements that are not the
# tensors'. On a GPU nothing stops it: the loads return whatever lies there and the stores
# overwrite it, a bug that shows up later, elsewhere, or never. On the CPU the course's checked
# interpreter (`fastdl_lab/bounds.py`) refuses the access and names it:

# %%
@triton.jit
def scaled_add_no_mask(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, alpha * tl.load(x_ptr + offs) + tl.load(y_ptr + offs))


if device.interpreting() and bounds.enabled():
    try:
        scaled_add.scaled_add(x, y, 0.5, kernel=scaled_add_no_mask, block=256)
    except bounds.OutOfBoundsAccess as exc:
        print(f"without the mask: {exc}")
else:  # unchecked, the overrun would really happen: not launched
    print("not launched here: the unmasked store would write past the end of out, unreported")

# %% [markdown]
# ### Two dimensions: a block of pointers
#
# A matrix is still one line of memory: element `(i, j)` lies at offset
# `i * stride_m + j * stride_n`. A 2-D kernel builds its block of pointers from two 1-D blocks of
# offsets, `rows[:, None] * stride_m + cols[None, :] * stride_n`, which broadcast to
# `BLOCK_M × BLOCK_N` offsets, and masks it with `(rows[:, None] < M) & (cols[None, :] < N)`.
# Below, memory holds the 48 values of a row-major 6 × 8 matrix `x`, drawn in lines of 8. Left:
# the 3 × 4 block at corner `(1, 2)` of `x` (strides 8, 1). Right: the 3 × 4 block at corner
# `(2, 1)` of `x.t()`, the same memory seen as an 8 × 6 matrix (strides 1, 8). Row-major, each
# row of the block is four neighbouring offsets, the coalesced pattern of section 3; through the
# transpose, neighbouring elements of a block row are 8 apart.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 2.6))
views = [("x, 6 x 8: corner (1, 2), strides (8, 1)", (1, 2, 3, 4, 8, 1)),
         ("x.t(), 8 x 6: corner (2, 1), strides (1, 8)", (2, 1, 3, 4, 1, 8))]
for ax, (title, args) in zip(axes, views, strict=True):
    block = scaled_add.pointer_block(*args)
    memory = np.isin(np.arange(48), block).reshape(6, 8)  # memory drawn in lines of 8 elements
    ax.imshow(memory, cmap="Oranges", vmin=-0.3, vmax=1.3)
    for (r, c), hit in np.ndenumerate(memory):
        ax.text(c, r, r * 8 + c, ha="center", va="center", fontsize=7, fontweight="bold" if hit else "normal")
    ax.set_title(f"{title}\noffsets read: {block.tolist()}", fontsize=7)
    ax.set_xticks([]), ax.set_yticks([])
plt.show()

# %% [markdown]
# ### Row sums
#
# The warm-up kernel sums every row of an `M × N` matrix $x$ into a vector $y$ of length `M`.
# It is a matrix multiply by a column of ones, and its kernel has the GEMM's skeleton without
# the tiling: once it works, section 5 adds a second operand and `tl.dot`.
#
# Write `row_sum_kernel` with exactly the signature below. The launcher
# `rowsum.row_sum(x, kernel=..., block_m=..., block_n=...)` validates `x`, allocates $y$
# (filled with NaN on the CPU, so a row you never write is caught) and launches
# `cdiv(M, BLOCK_M)` programs on a 1-D grid. Element `(i, j)` of $x$ is at
# `x_ptr + i * stride_xm + j * stride_xn`: the tests pass padded rows (`stride_xm > N`) and
# transposed matrices (`stride_xm == 1`), so use both strides.
#
# Your kernel must:
#
# 1. **find its rows**: program `pid = tl.program_id(0)` owns rows
#    `pid * BLOCK_M + tl.arange(0, BLOCK_M)`, a block of `BLOCK_M` row indices;
# 2. **walk along the columns** in steps of `BLOCK_N`: `for start in range(0, N, BLOCK_N)`, with
#    column offsets `start + tl.arange(0, BLOCK_N)`. Rows along one axis and columns along the
#    other make a 2-D block of pointers: `rows[:, None]` is a column, `cols[None, :]` a row, and
#    arithmetic between them broadcasts to `BLOCK_M × BLOCK_N`;
# 3. **mask** every load: the last program's rows may run past `M` and the last step's columns
#    past `N`. `tl.load(ptrs, mask=m, other=0.0)` reads only where `m` is true and gives 0
#    elsewhere, so the padding adds nothing. Without the mask the kernel reads the neighbour row,
#    the padding, or memory that is not the tensor's at all;
# 4. **accumulate in fp32** (`tl.zeros((BLOCK_M,), dtype=tl.float32)`, loads converted with
#    `.to(tl.float32)`, `tl.sum(block, axis=1)` per step), whatever the input type: a long fp16
#    sum accumulated in fp16 loses its low digits;
# 5. **store** one value per row, converted to $y$'s element type (`y_ptr.dtype.element_ty`),
#    with a mask on the rows.
#
# `M` and `N` are not multiples of the blocks in the tests. On the CPU every load and store is
# checked (`fastdl_lab/bounds.py`): one outside the tensors raises `OutOfBoundsAccess`, naming the
# kernel, the argument, the element and the program.

# %% nbgrader={"grade_id": "row_sum_kernel_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def row_sum_kernel(
    x_ptr, y_ptr,
    M, N,
    stride_xm, stride_xn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    ### BEGIN SOLUTION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        ptrs = x_ptr + rows[:, None] * stride_xm + c[None, :] * stride_xn
        x = tl.load(ptrs, mask=row_ok[:, None] & (c[None, :] < N), other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)
    ### END SOLUTION


# %% nbgrader={"grade_id": "row_sum", "grade": true, "points": 2}
import torch

from fastdl_lab import checks, device, rowsum

_dev = "cuda" if device.has_gpu() else "cpu"


def _try_rows(x, name, **blocks):
    rowsum.check_row_sum(rowsum.row_sum(x, kernel=row_sum_kernel, **blocks), x, name=name)


# One program; ragged rows and columns; a row longer than its block; padded rows; a transpose.
_try_rows(checks.randn(1, 5, seed=1, device=_dev), "1 x 5")
_try_rows(checks.randn(37, 300, seed=2, device=_dev), "37 x 300")
_try_rows(checks.randn(21, 50, seed=3, device=_dev), "21 x 50, 8 x 16 blocks", block_m=8, block_n=16)
_wide = checks.randn(19, 64, seed=4, device=_dev)
_try_rows(_wide[:, :45], "19 x 45 inside 19 x 64 rows")
_try_rows(_wide.t(), "64 x 19, transposed")
print("row_sum: visible tests passed")
### BEGIN HIDDEN TESTS
_try_rows(checks.randn(130, 77, seed=5, device=_dev), "130 x 77, 16 x 16 blocks", block_m=16, block_n=16)
_try_rows(checks.randn(200, 1, seed=6, device=_dev), "200 x 1")
_try_rows(checks.randn(33, 1000, dtype=torch.float16, seed=7, device=_dev), "fp16 33 x 1000")
_wide = checks.randn(40, 100, seed=8, device=_dev)
_try_rows(_wide[3:, 7:90], "37 x 83 inside 40 x 100 rows", block_m=4, block_n=32)
_try_rows(_wide.t()[:61], "61 x 40 transposed")
### END HIDDEN TESTS

# %% [markdown]
# **What one program becomes.** `rowsum.ptx` compiles the same kernel for an H100 twice: as a
# launch on row-major rows would be, where Triton sees `stride_xn == 1` and turns it into a
# constant, and with the column stride left unknown. `.reqntid` is the number of threads per
# program (32 × `num_warps`); `ld.global` are loads from memory. With the stride known to be 1,
# each thread loads four neighbouring fp32 values per instruction (`ld.global.v4`); without it,
# one at a time. On a GPU, the same sum over a transposed (column-major) matrix shows what
# uncoalesced loads cost.

# %%
for contiguous in (True, False):
    listing = rowsum.ptx(90, torch.float32, contiguous=contiguous, kernel=row_sum_kernel)
    threads = next(line.split()[1] for line in listing.splitlines() if ".reqntid" in line)
    loads = [line.split()[1] for line in listing.splitlines() if "ld.global" in line]
    print(f"stride_xn {'== 1 ' if contiguous else 'unknown'}: {threads} threads per program, "
          f"{len(loads)} load instructions per thread per step: {sorted(set(loads))}")

if GPU:
    x = checks.randn(8192, 8192, device="cuda", seed=0)
    xt = x.t().contiguous().t()  # the same matrix, stored column by column
    cmp = timing.compare(lambda: rowsum.row_sum(xt, kernel=row_sum_kernel),
                         lambda: rowsum.row_sum(x, kernel=row_sum_kernel))
    print(f"row sums of a column-major matrix vs a row-major one: {cmp}")
else:
    print("needs a GPU: uncoalesced loads cost bandwidth on a GPU, the interpreter only emulates the kernel")

# %% [markdown]
# ## 5. Tiling: reuse every byte you load
#
# A GPU kernel that computed each $C_{ij}$ on its own would read a row of $A$ and a column of $B$
# for $2k$ FLOPs: 2 FLOPs per 2 loaded values, 0.25 FLOP/B in fp32 — deep in memory-bound
# territory. **Tiling** fixes this. Each program computes a `BLOCK_M × BLOCK_N` tile of $C$,
# as your row-sum program computed `BLOCK_M` sums. It walks along $K$ in steps of `BLOCK_K`,
# as the row sum walked along the columns, each time loading a `BLOCK_M × BLOCK_K` tile of $A$
# and a `BLOCK_K × BLOCK_N` tile of $B$ and multiplying them with `tl.dot`, which stages them
# in shared memory and runs on the tensor cores (section 8); the accumulator stays in
# registers. Per step it moves $(B_M + B_N) B_K$ values and performs
# $2 B_M B_N B_K$ FLOPs, so its intensity against whatever feeds it is
# $\frac{2 B_M B_N}{(B_M + B_N)\cdot\text{bytes}}$:

# %%
h100 = device.PEAKS["h100"]
ridge = h100.fp16_tflops * 1e3 / h100.mem_bw_gbs
for bm, bn in [(16, 16), (32, 32), (64, 64), (128, 128), (128, 256), (256, 256)]:
    ai = 2 * bm * bn / ((bm + bn) * 2)
    print(f"{bm:3d}x{bn:<3d} fp16 tiles: {ai:6.1f} FLOP/B  (H100 fp16 ridge: {ridge:.0f})")

# %% [markdown]
# Even 128×128 tiles fall short of the H100's ridge if every tile came from DRAM. They do not
# all have to: programs running at the same time that need the same tiles of $A$ or $B$ find
# them in the L2 cache. Section 7 arranges for that.
#
# ### Your kernel
#
# Write `matmul_kernel` with exactly the signature below: $A$ is `M × K`, $B$ is `K × N`, $C$ is
# `M × N`, each addressed through its two strides (element `(i, j)` of $A$ is at
# `a_ptr + i * stride_am + j * stride_ak`). The launcher `gemm.matmul(a, b, kernel=...)`
# validates the inputs, allocates $C$ (filled with NaN on the CPU, so a tile you never write
# is caught), and launches one program per output tile, `cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)`
# programs on a 1-D grid.
#
# Your kernel must:
#
# 1. map `tl.program_id(0)` to a tile `(pid_m, pid_n)`. Row-major
#    (`pid // num_pid_n, pid % num_pid_n`) is correct; the grouped order of section 7 is
#    faster on a GPU (use it once you have written `grouped_pid`);
# 2. build the row offsets `pid_m * BLOCK_M + tl.arange(0, BLOCK_M)`, the column offsets, and
#    `tl.arange(0, BLOCK_K)`, and from them 2-D blocks of pointers into $A$ and $B$
#    (broadcast with `[:, None]` and `[None, :]`);
# 3. loop over $K$ in `tl.cdiv(K, BLOCK_K)` steps: load both tiles with a **mask** so that rows,
#    columns and the last partial `K` step outside the matrices read `other=0.0` (zeros add
#    nothing to the sum), accumulate `acc = tl.dot(a, b, acc)` into an fp32 accumulator
#    (`tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)`), then advance the pointers;
# 4. store the accumulator converted to $C$'s element type (`c_ptr.dtype.element_ty`), masked to
#    the matrix.
#
# Shapes are **ragged**: `M`, `N` and `K` are not multiples of the blocks. Out-of-range loads are
# not checked on the CPU and an unmasked out-of-range store can crash the whole kernel process.
#
# Once it passes, two refinements make the K loop cheaper, as in the reference kernel: masks
# cost a compare and a select per element on every K step.
#
# - **Wrapped offsets.** Instead of masking rows and columns past the edge, wrap them round,
#   `offs_m % M` and `offs_n % N`, when building the load pointers: every load is then in bounds,
#   and the products of wrapped rows land in rows of the tile that the (still masked) store drops.
#   `K` cannot wrap: a wrapped `k` would add its products into the sum.
# - **`EVEN_K`.** The launcher passes `EVEN_K=True` when `BLOCK_K` divides `K` (to a kernel that
#   declares the parameter, as the signature below does): a constexpr, so `if EVEN_K:` compiles
#   a K loop with no mask at all, and the masked loop is only built for ragged `K`.

# %% nbgrader={"grade_id": "matmul_kernel_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr = False,
):
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap round to real ones: loads need no M or N mask, and
    # what they bring lands in parts of the tile the store masks off.
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    ### END SOLUTION


# %% nbgrader={"grade_id": "matmul_fp32", "grade": true, "points": 4}
import torch

from fastdl_lab import checks, device, gemm

_dev = "cuda" if device.has_gpu() else "cpu"


def _try(m, n, k, dtype, seed, **blocks):
    a = checks.randn(m, k, dtype=dtype, seed=seed, device=_dev)
    b = checks.randn(k, n, dtype=dtype, seed=seed + 1, device=_dev)
    c = gemm.matmul(a, b, kernel=matmul_kernel, **blocks)
    gemm.check_matmul(c, a, b, name=f"C for M,N,K={m},{n},{k} {dtype}")


# One tile; ragged inside one tile; ragged over several tiles in every dimension.
for _shape in [(1, 1, 1), (37, 45, 50), (130, 70, 100)]:
    _try(*_shape, torch.float32, seed=10)
print("matmul_fp32: visible tests passed")
### BEGIN HIDDEN TESTS
for _shape in [(64, 64, 32), (3, 129, 257), (200, 17, 65)]:
    _try(*_shape, torch.float32, seed=20)
_try(70, 50, 40, torch.float32, seed=30, block_m=16, block_n=16, block_k=16, group_m=3)
_a = checks.randn(40, 70, seed=40, device=_dev).t()
_b = checks.randn(50, 40, seed=41, device=_dev).t()
gemm.check_matmul(gemm.matmul(_a, _b, kernel=matmul_kernel), _a, _b, name="transposed operands")
### END HIDDEN TESTS

# %% nbgrader={"grade_id": "matmul_fp16", "grade": true, "points": 2}
import torch

for _shape in [(1, 1, 1), (37, 45, 50), (130, 70, 100)]:
    _try(*_shape, torch.float16, seed=50)
print("matmul_fp16: visible tests passed (no worse than twice PyTorch's fp16 error)")
### BEGIN HIDDEN TESTS
for _shape in [(3, 129, 257), (200, 17, 65)]:
    _try(*_shape, torch.float16, seed=60)
_try(70, 50, 40, torch.float16, seed=70, block_m=16, block_n=32, block_k=16, group_m=2)
### END HIDDEN TESTS

# %% [markdown]
# ## 6. What your kernel compiles to
#
# The interpreter never produces GPU code, so passing the tests above on a CPU does not prove
# the kernel compiles for a GPU. Triton's compiler, however, needs no GPU when told the target.
# `gemm.ptx(capability, dtype, kernel=...)` compiles a kernel with GEMM's signature to PTX, the
# GPU's portable assembly, for compute capability 8.0 (A100) or 9.0 (H100/H200). Look for the
# tensor-core instructions: `mma.sync` on Ampere, the asynchronous warp-group `wgmma` on Hopper,
# and `cp.async`, the copies that let the next K tile load while the current one is multiplied.

# %%
for cap in (80, 90):
    ptx = gemm.ptx(cap, torch.float16, kernel=matmul_kernel)
    print(f"sm_{cap} ({triton_aot.CAPABILITIES[cap]}):", triton_aot.ptx_summary(ptx))
# The instruction's shape suffix says it all: for the H100's default 128x256 tile, a 64x256x16
# step of one warp group, fp32 accumulator, fp16 inputs.
print(next(line.split()[0] for line in ptx.splitlines() if "wgmma.mma_async" in line))

# %% [markdown]
# ## 7. Grouped launch order
#
# A GPU runs as many programs at once as its SMs have room for: for 128 × 128 tiles one or two
# per SM, a wave of 132 to 264 programs on an H100 (section 10 counts them). They all want tiles
# of $A$ and $B$. With **row-major** order, consecutive programs compute
# the tiles of one row of $C$: they share one row-block of $A$ but each needs a different
# column-block of $B$, so a wave of programs touches a whole band of $B$.
#
# The **grouped** order walks *bands* of `group_m` tile rows: inside a band it goes down a
# column before moving to the next column. A wave then covers a roughly square patch of $C$, and
# reads about $2\sqrt{\text{wave}}$ blocks instead of $1 + \text{wave}$: far fewer distinct
# blocks, so more of its loads hit L2. When `group_m` does not divide the number of tile rows the
# last band is shorter.
#
# **Your task:** `grouped_pid(pid, num_pid_m, num_pid_n, group_m) -> (pid_m, pid_n)` in plain
# Python. For a grid of 5 × 3 tiles with `group_m = 2`, programs 0–5 compute tiles
# (0,0) (1,0) (0,1) (1,1) (0,2) (1,2), programs 6–11 the same pattern on rows 2–3, and programs
# 12–14 the lone fifth row: (4,0) (4,1) (4,2). Then use the same arithmetic in your kernel.

# %% nbgrader={"grade_id": "grouped_order_code", "solution": true}
def grouped_pid(pid, num_pid_m, num_pid_n, group_m):
    """Tile (pid_m, pid_n) computed by program ``pid`` in the grouped launch order."""
    ### BEGIN SOLUTION
    per_group = group_m * num_pid_n
    first_m = (pid // per_group) * group_m
    rows = min(num_pid_m - first_m, group_m)
    local = pid % per_group
    return first_m + local % rows, local // rows
    ### END SOLUTION


# %% nbgrader={"grade_id": "grouped_order", "grade": true, "points": 2}
from fastdl_lab import gemm

_order = [tuple(grouped_pid(p, 5, 3, 2)) for p in range(15)]
assert _order[:6] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)], _order[:6]
assert _order[12:] == [(4, 0), (4, 1), (4, 2)], "the last, shorter group: " + str(_order[12:])
assert sorted(_order) == [(i, j) for i in range(5) for j in range(3)], "every tile exactly once"
_grouped = gemm.tiles_touched(grouped_pid, 32, 32, 128, group_m=8)
_row = gemm.tiles_touched(gemm.row_major_pid, 32, 32, 128)
print(f"grouped_order: visible tests passed; a wave of 128 programs on 32x32 tiles reads "
      f"{_grouped} blocks grouped vs {_row} row-major")
### BEGIN HIDDEN TESTS
def _expected_order(m, n, g):
    order = []
    for first in range(0, m, g):
        band = range(first, min(first + g, m))
        order += [(row, col) for col in range(n) for row in band]
    return order


for _m, _n, _g in [(1, 1, 1), (7, 9, 3), (3, 5, 8), (6, 4, 1), (13, 2, 4), (16, 16, 8)]:
    assert [tuple(grouped_pid(p, _m, _n, _g)) for p in range(_m * _n)] == _expected_order(_m, _n, _g), (_m, _n, _g)
assert _grouped == 24 and _row == 36
### END HIDDEN TESTS

# %% [markdown]
# The picture: launch order over an 8 × 8 grid of tiles, with the first wave of 16 programs
# shaded. Row-major's wave spans two rows of $C$ — 2 row-blocks of $A$ and all 8 column-blocks
# of $B$; grouped by 4 it covers a 4 × 4 patch, 4 + 4 blocks.

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 3.8))
orders = [("row-major", gemm.row_major_pid, {}), ("grouped, group_m=4", grouped_pid, {"group_m": 4})]
for ax, (title, fn, kw) in zip(axes, orders, strict=True):
    order = np.zeros((8, 8), dtype=int)
    for pid in range(64):
        order[fn(pid, 8, 8, **kw)] = pid
    ax.imshow(order < 16, cmap="Blues", vmin=0, vmax=1.6)
    for (i, j), pid in np.ndenumerate(order):
        ax.text(j, i, pid, ha="center", va="center", fontsize=7)
    ax.set_title(f"{title}: {gemm.tiles_touched(fn, 8, 8, 16, **kw)} blocks for the first 16", fontsize=9)
    ax.set_xticks([]), ax.set_yticks([])
plt.show()

# %% [markdown]
# ## 8. Tensor cores and TF32
#
# Tensor cores multiply small matrix tiles in one instruction, at 8–16× the rate of ordinary fp32
# arithmetic. They take 16-bit inputs (fp16, bf16) — and, since Ampere, **TF32**: a 19-bit format
# with fp32's 8-bit exponent (same range) but only fp16's 10 mantissa bits. Products are
# accumulated in fp32. The inputs are rounded to a relative precision of $2^{-11} \approx 5\cdot
# 10^{-4}$ instead of fp32's $2^{-24} \approx 6\cdot 10^{-8}$.
#
# - PyTorch does **not** use TF32 for fp32 matmuls by default. Opt in with
#   `torch.backends.cuda.matmul.allow_tf32 = True`, or `torch.set_float32_matmul_precision("high")`.
# - Triton's `tl.dot` **does** use TF32 for fp32 inputs by default (`input_precision="tf32"`;
#   `"ieee"` forces true fp32). Your kernel on fp32 GPU tensors is therefore a TF32 kernel, which
#   is why the tests above judge fp32 results on a GPU by the low-precision rule.
#
# Neural network training tolerates this rounding well. A quick look at what it does to one
# product, emulated on the CPU by rounding the inputs' mantissas to 10 bits. Expect TF32 to lose
# about as much as fp16 inputs do: the two formats keep the same 10-bit mantissa, and fp16 adds
# only what its narrower exponent range costs (values near its limits underflow or overflow).

# %%
def round_to_tf32(x):
    bits = x.contiguous().view(torch.int32)
    # Round to nearest at bit 13, then clear the 13 low mantissa bits fp32 has and TF32 lacks.
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


n = 512
a, b = torch.randn(n, n), torch.randn(n, n)
exact = a.double() @ b.double()
for name, c in [("fp32", a @ b), ("tf32 (emulated)", round_to_tf32(a) @ round_to_tf32(b)),
                ("fp16 inputs", (a.half().float() @ b.half().float()))]:
    rel = ((c.double() - exact).norm() / exact.norm()).item()
    print(f"{name:>16}: relative error {rel:.1e}")

# %%
if GPU:
    n = 8192
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")

    def tf32_matmul():
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return a @ b
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous

    cmp = timing.compare(tf32_matmul, lambda: a @ b)
    print(f"TF32 vs fp32 cuBLAS, {n}^3: {cmp}")
else:
    print("needs a GPU: TF32 is a tensor-core format")

# %% [markdown]
# ### Shapes tensor cores like
#
# A tensor-core instruction multiplies a fixed tile (for fp16 on Ampere, `mma.sync` is
# 16 × 8 × 16), and the kernels that feed it load each row of an operand in 16-byte vectors. The
# sizes of M, N and K therefore matter. NVIDIA's *Matrix Multiplication Background* guide states
# the rule in its Table 1: before cuBLAS 11.0, fp16 GEMMs used tensor cores only when the
# dimensions were **multiples of 8** (16 bytes); since 11.0 they always may, but run most
# efficiently at multiples of 8, and on an A100 at **multiples of 64** (128 bytes). For TF32 the
# same bytes are 4 and 32 elements, for int8 16 and 128. A dimension one short, K = 4095 in
# fp16, puts every row of a row-major A but the first off its 16-byte boundary: the aligned
# vector loads are no longer allowed, and the library falls back to a slower kernel.
#
# `shapes.aligned` checks the rule; `timing.compare` times a product with K = 4095 against
# K = 4096. A CPU's BLAS has no tensor cores and no such cliff, so whatever ratio it shows says
# nothing about them; the tensor-core effect needs a GPU.

# %%
from fastdl_lab import shapes

for m, n, k in [(4096, 4096, 4096), (4096, 4096, 4095), (8, 50257, 768), (8, 50304, 768)]:
    rule = shapes.aligned(m, n, k, torch.float16)
    print(f"fp16 M,N,K = {m},{n},{k}: " + ", ".join(
        f"{d} {'128 B' if r['128 B'] else '16 B' if r['16 B'] else 'misaligned'}" for d, r in rule.items()))
m = 64 if QUICK else 512
a_odd, b_odd = shapes.k_alignment_operands(4095, m, m, dev=DEV)
a_even, b_even = shapes.k_alignment_operands(4096, m, m, dev=DEV)
cmp = timing.compare(lambda: a_odd @ b_odd, lambda: a_even @ b_even, reps=3 if QUICK else 20)
print(f"fp32 on {DEV}, {m}x{m} outputs, K=4095 vs K=4096: {cmp}")
if GPU:
    for k in (4095, 4088):  # 4088 = 511 x 8: aligned, one step of 8 short of 4096
        a, b = shapes.k_alignment_operands(k, 8192, 8192, torch.float16, "cuda")
        a64, b64 = shapes.k_alignment_operands(4096, 8192, 8192, torch.float16, "cuda")
        print(f"fp16 8192x8192, K={k} vs K=4096: {timing.compare(lambda: a @ b, lambda: a64 @ b64)}")
else:
    print("needs a GPU: the K=4095 cliff is the tensor cores' and their 16-byte loads'")

# %% [markdown]
# **Padding a vocabulary.** The one dimension a model designer rarely chooses is the vocabulary:
# GPT-2's has 50 257 tokens, odd, so its output projection (hidden size → 50 257 logits, the
# largest matmul of a small language model) is misaligned in N. The fix is to pad the vocabulary to
# a multiple of 64, 50 304, with rows no token id ever reaches: `shapes.pad_embedding` adds zero
# rows to the embedding table, and `shapes.pad_lm_head` computes 50 304 logits and slices the
# first 50 257 back, so a softmax or a loss never sees the padding. The model computes the same:

# %%
vocab, hidden = (1000, 32) if QUICK else (50257, 256)
torch.manual_seed(0)
embedding, head = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab)
padded_embedding, padded_head = shapes.pad_embedding(embedding), shapes.pad_lm_head(head)
tokens = torch.randint(0, vocab, (2, 16))
logits, padded_logits = head(embedding(tokens)), padded_head(padded_embedding(tokens))
assert padded_logits.shape == logits.shape and torch.allclose(padded_logits, logits, atol=1e-6)
rows = padded_head.proj.out_features
assert rows % 64 == 0 and rows - vocab < 64
print(f"vocabulary {vocab} -> {rows} rows in the head and the table; logits {tuple(padded_logits.shape)}, "
      f"the same as unpadded")

# %% [markdown]
# ## 9. Every version on the roofline
#
# Each point: the rate achieved (minimum-traffic FLOPs over time) against the arithmetic
# intensity of the whole product, on this machine's measured roofline. Pure Python sits orders
# of magnitude under the roof; BLAS reaches it. On a GPU, your Triton kernel and cuBLAS join
# them. (In lab 00 you computed these FLOP and byte counts: $2MNK$ and $(MK + KN + MN)$ elements.)

# %%
def place(label, fn, m, n, k, elem_bytes, reps=10):
    t = timing.bench(fn, warmup=1, reps=reps)
    flop = 2 * m * n * k
    intensity = flop / ((m * k + k * n + m * n) * elem_bytes)
    points[label] = (intensity, flop / t.median / 1e12)
    print(f"{label:>22}: {t}, {points[label][1]:.4g} TFLOP/s")


points = {}
n = 16 if QUICK else 48
a, b = torch.randn(n, n), torch.randn(n, n)
place(f"Python loops {n}", lambda: gemm.matmul_loops(a, b), n, n, n, 4, reps=1 if QUICK else 3)
n = 128 if QUICK else 512
a, b = torch.randn(n, n), torch.randn(n, n)
place(f"NumPy {n}", lambda: gemm.matmul_numpy(a, b), n, n, n, 4, reps=3 if QUICK else 10)
place(f"torch (CPU) {n}", lambda: torch.matmul(a, b), n, n, n, 4, reps=3 if QUICK else 10)
if GPU:
    roof = device.measure_roofline(dtype=torch.float16)
    n = 4096
    a = checks.randn(n, n, dtype=torch.float16, device="cuda", seed=1)
    b = checks.randn(n, n, dtype=torch.float16, device="cuda", seed=2)
    place("cuBLAS fp16 4096", lambda: torch.matmul(a, b), n, n, n, 2)
    place("your Triton fp16 4096", lambda: gemm.matmul(a, b, kernel=matmul_kernel), n, n, n, 2)
else:
    roof = device.measure_roofline(copy_bytes=4 << 20, matmul_n=256, reps=2) if QUICK else device.measure_roofline()
    print("Triton and cuBLAS points: needs a GPU (the interpreter's speed is not the kernel's)")
measure.plot_roofline(roof, points)
plt.show()

# %% [markdown]
# ## 10. Tuning the launch: tiles, `num_warps`, `num_stages`
#
# Your kernel's source fixes what each program computes; the launch decides how big a program
# is and how it runs. Six numbers matter, and `gemm.matmul` takes all of them
# (`gemm.check_config` says what each may be):
#
# - **the tile**, `block_m × block_n` with steps of `block_k`: larger tiles reuse every loaded
#   value more (section 5's intensity), but make fewer programs, each holding more;
# - **`group_m`**, the band height of section 7;
# - **`num_warps`**: threads per program, 32 × `num_warps`. The tile's values are divided among
#   them: a 128 × 128 fp32 accumulator is 16 384 values, 128 per thread at 4 warps and 64 at 8.
#   More warps mean fewer registers per thread and more warps for the schedulers to switch
#   between while loads are in flight, but more warp slots taken per program;
# - **`num_stages`**: how deep the compiler pipelines the K loop. With `s` stages it keeps the
#   $A$ and $B$ tiles of `s` K-steps in shared memory at once, so the loads of the next steps
#   (asynchronous copies into shared memory, the `cp.async` of section 6's PTX) are on their
#   way while `tl.dot` works on the current one. Shared memory per program grows with `s`: about
#   `s × (block_m + block_n) × block_k × bytes`.
#
# All of this is decided at compile time, so the compiler can tell you what a configuration
# costs without a GPU. Below, your kernel is compiled for an H100 with a few configurations;
# for each: registers per thread and shared memory per program (from the compiled cubin),
# how many programs fit on one SM and which resource stops more (`simt.occupancy`), how many
# waves a 4096³ fp16 product then takes on 132 SMs (`simt.waves`: 3.9 means four rounds, the
# last one 90% full), and the tile's intensity against what feeds it. A configuration whose
# registers overflow shows *spilled* bytes (the thread's stack frame, in memory: slow); one whose
# shared memory does not fit cannot launch at all.

# %%
TUNING = [
    {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2},
    {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3},
]
rows = []
for config in TUNING[1:3] if QUICK else TUNING:
    used = gemm.resources(90, torch.float16, kernel=matmul_kernel, **config)
    fit = simt.occupancy(used["registers"], used["shared_bytes"], config["num_warps"], "h100")
    programs = triton.cdiv(4096, config["block_m"]) * triton.cdiv(4096, config["block_n"])
    bm, bn = config["block_m"], config["block_n"]
    rows.append({**config, "registers": used["registers"], "spilled bytes": used["stack_bytes"] + used["local_bytes"],
                 "shared KiB": used["shared_bytes"] / 1024, "programs per SM": fit.programs_per_sm,
                 "limited by": fit.limited_by, "waves (4096^3)": simt.waves(programs, fit.programs_per_sm, "h100"),
                 "tile FLOP/B": 2 * bm * bn / ((bm + bn) * 2)})
pd.DataFrame(rows).round(2)

# %% [markdown]
# Read the table before timing anything. Going from 4 to 8 warps roughly halves the registers
# each thread needs for the same tile; a deeper pipeline or a longer `block_k` multiplies the
# shared memory, and past a point only one program fits on an SM, so nothing else runs while it
# waits at a synchronisation. There is no single best row: the clock decides, and it differs
# between GPUs (an A100 has 164 KiB of shared memory per SM, a T4 64 KiB: what fits on an H100
# may not launch there).
#
# The package's own `gemm.matmul(a, b)` (no kernel, no option) does this search itself on a GPU:
# `triton.autotune` times each of `gemm.autotune_configs(capability)`, a handful of
# configurations per architecture that all compile without spills and fit the SM's shared
# memory, on the first call for every new (M, N, K), and keeps the fastest. Your kernel is
# launched with the one configuration you choose.
#
# **Your task (graded on GPU profiles).** Choose `MATMUL_CONFIG`, the configuration the grader
# launches your kernel with when it times it against cuBLAS in section 11. Any of the six keys
# may be given; those left out take `gemm.default_config`'s values. On a GPU, time a few
# candidates with the cell below and keep the fastest; without one, reason from the table (and
# keep within the shared memory of the GPU you will be graded on). The choice is checked on
# every machine; it is timed only on GPU profiles.

# %%
if GPU:
    a = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=0)
    b = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=1)
    for config in TUNING:
        try:
            cmp = timing.compare(lambda: gemm.matmul(a, b, kernel=matmul_kernel, **config), lambda: torch.matmul(a, b))
            print(f"{config}: {cmp.speedup:.2f}x torch.matmul")
        except Exception as exc:  # a configuration this GPU cannot launch (out of shared memory)
            print(f"{config}: does not run here: {type(exc).__name__}: {str(exc)[:120]}")
else:
    print("needs a GPU: timing configurations needs the real kernel; the table above does not")

# %% nbgrader={"grade_id": "matmul_tuning_code", "solution": true}
### BEGIN SOLUTION
# Two 128 x 128 programs per SM on an H100 (registers) with a three-stage pipeline of 48 KiB,
# which also fits an A100 and a T4.
MATMUL_CONFIG = {"block_m": 128, "block_n": 128, "block_k": 32, "group_m": 8, "num_warps": 4, "num_stages": 3}
### END SOLUTION

# %% [markdown]
# ## 11. Speed
#
# The last graded item times your kernel, launched with `MATMUL_CONFIG`, against
# `torch.matmul` (cuBLAS) on a 4096³ fp16 product, interleaved, on a GPU grading profile.
# Reaching cuBLAS is hard; getting within a small factor of it with forty lines of Triton is
# the point. On a CPU this cell checks your configuration and reports that the timing needs a
# GPU: the autograder decides it.

# %% nbgrader={"grade_id": "matmul_speed", "grade": true, "points": 2}
import torch

from fastdl_lab import checks, device, gemm, timing

_config = gemm.check_config(MATMUL_CONFIG)
if device.has_gpu():
    _a = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=0)
    _b = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=1)
    _cmp = timing.compare(lambda: gemm.matmul(_a, _b, kernel=matmul_kernel, **_config), lambda: torch.matmul(_a, _b))
    print(f"your kernel vs torch.matmul: {_cmp.speedup:.2f}x (95% CI {_cmp.ci_low:.2f}-{_cmp.ci_high:.2f})")
else:
    print(f"MATMUL_CONFIG {_config} is valid; needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## 12. Convolution as a matrix multiply
#
# A convolution layer is a GEMM in disguise. Output pixel `(p, q)` of filter `o` is the dot
# product of that filter's `C × KH × KW` weights with the `C × KH × KW` input values under the
# window at `(p, q)`. Copy those values out, one column per output pixel, and the layer becomes
# one matrix product:
#
# $$\underbrace{W}_{O \times C K_H K_W} \cdot \underbrace{\text{cols}(x)}_{C K_H K_W \times O_H O_W}
#   = \underbrace{y}_{O \times O_H O_W} \quad\text{per image.}$$
#
# Building `cols(x)` is **im2col** ("image to columns"). `im2col.im2col` takes one strided slice
# of the padded input per kernel offset `(i, j)`: slice `(i, j)` holds, at every output position,
# the input pixel that offset sees, stepping by the stride. Stacking the `KH × KW` slices gives the
# columns; `im2col.conv2d_im2col` multiplies them by the flattened filters and adds the bias.

# %%
from fastdl_lab import im2col

for (n, c, h, w), (o, k), stride, padding in [((2, 3, 10, 9), (4, 3), 1, 1), ((1, 5, 11, 11), (6, 5), 2, 2),
                                                ((2, 4, 8, 8), (3, 1), 1, 0)]:
    x, weight, bias = checks.randn(n, c, h, w, seed=1), checks.randn(o, c, k, k, seed=2), checks.randn(o, seed=3)
    ours = im2col.conv2d_im2col(x, weight, bias, stride=stride, padding=padding)
    theirs = torch.nn.functional.conv2d(x, weight, bias, stride=stride, padding=padding)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), (ours - theirs).abs().max()
    cols = im2col.im2col(x, k, stride, padding)
    print(f"{k}x{k} conv, stride {stride}, padding {padding}: x {tuple(x.shape)} -> columns {tuple(cols.shape)} "
          f"-> y {tuple(ours.shape)}; matches F.conv2d")

# %% [markdown]
# **The price is memory.** Every input value sits under up to `KH × KW` windows, so im2col copies
# it up to `KH × KW` times: the columns hold $K_H K_W \cdot O_H O_W / (H W)$ elements per input
# element, about $K_H K_W / \text{stride}^2$. A 3 × 3 convolution with padding 1 makes **9
# copies** of its input; a 1 × 1 convolution makes none (its im2col is a reshape, the layer was
# already a GEMM). For one ResNet-50 stage-1 layer, 64 channels of 56 × 56 at a batch of 256:

# %%
n, c, h = 256, 64, 56
for k, stride, padding in [(3, 1, 1), (3, 2, 1), (7, 2, 3), (1, 1, 0)]:
    grow = im2col.im2col_expansion(h, h, k, stride, padding)
    print(f"{k}x{k} stride {stride}: input {n * c * h * h * 4 / 2**20:6.0f} MiB fp32, "
          f"columns {grow * n * c * h * h * 4 / 2**20:7.0f} MiB ({grow:.2f}x)")

# %% [markdown]
# Moving that matrix through memory costs what it weighs: the GEMM itself is efficient, but it is
# fed by a write and a read of `KH × KW` times the input. This is why cuDNN's main algorithms are
# **implicit GEMM**: the kernel is a tiled matmul like yours, whose loads of the "B" tile compute
# the input addresses of each column on the fly (from the output pixel, the kernel offset, the
# stride and the padding, with a mask for the padding), so the columns only ever exist as tiles in
# shared memory. cuDNN still offers the explicit version (`CUDNN_CONVOLUTION_FWD_ALGO_GEMM`, which
# needs a workspace the size of the columns) among others (FFT, Winograd); with
# `torch.backends.cudnn.benchmark = True` PyTorch times the candidates for each new shape and
# keeps the fastest.
#
# On this machine, the explicit route against PyTorch's own convolution:

# %%
if QUICK:  # a second of timing per graded run buys nothing
    print("the timing is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    x = checks.randn(32, 32, 28, 28, device=DEV, seed=4)
    weight = checks.randn(64, 32, 3, 3, device=DEV, seed=5)
    cmp = timing.compare(lambda: im2col.conv2d_im2col(x, weight, padding=1),
                         lambda: torch.nn.functional.conv2d(x, weight, padding=1))
    print(f"im2col + matmul vs F.conv2d, {tuple(x.shape)} * 64 3x3 filters: {cmp}")

# %% [markdown]
# ## 13. Before CUDA: a matrix multiply as render passes
#
# GPUs computed matrix products before they could be programmed for anything but drawing
# (Larsen & McAllister, 2001; Krüger & Westermann, 2003). The recipe: store A and B as
# **textures**; make C the **render target**, one pixel per element; draw one rectangle over the
# target, which runs a **fragment shader** once per pixel. The shader for pixel $(i, j)$ fetches
# row $i$ of A and column $j$ of B, texel by texel, and writes their dot product. Two limits of
# the hardware shaped the algorithm:
#
# - a shader had a bounded length, so a long $K$ could not be one shader: the product was
#   drawn in several **passes**, each adding a $K$-chunk's partial products to the previous
#   pass's result;
# - a shader cannot read the target it writes, so the passes **ping-pong** between two targets.
#
# `shaders.render_single_pass` and `shaders.render_multi_pass` emulate both, one "fragment" per
# output element, and count what each fragment fetches:

# %%
from fastdl_lab import shaders

a_tex, b_tex = checks.randn(16, 200, seed=1), checks.randn(200, 24, seed=2)
try:
    shaders.render_single_pass(a_tex, b_tex)
except ValueError as exc:
    print("single pass:", exc)
for k_per_pass in (64, 16):
    c_tex, render = shaders.render_multi_pass(a_tex, b_tex, k_per_pass)
    checks.assert_close(c_tex, a_tex @ b_tex, atol=1e-4, rtol=1e-4, name="render passes")
    print(f"{k_per_pass} elements of K per pass: {render.passes} passes, {render.fetches_per_output} texels "
          f"fetched per output")
print(f"a 64 x 64 tiled kernel loads {shaders.tiled_loads_per_output(200, 64, 64):.2f} elements per output "
      f"from global memory")

# %% [markdown]
# Every fragment fetches its own $2K$ texels and nothing is shared between fragments; only the
# texture cache softened that. Fatahalian, Sugerman & Hanrahan (2004) measured such products
# bound by fetch bandwidth, far below the arithmetic the GPUs of the time could do. CUDA's
# **shared memory** changed the arithmetic: a block of threads loads a tile of A and of B once
# and every thread of the block reuses it, so a $64 \times 64$ tile loads $K/64 + K/64$ elements
# per output instead of $2K$, 64 times fewer: the tiled kernel you wrote in section 5.

# %% [markdown]
# ## Summary
#
# - A matrix multiply does $O(n^3)$ work on $O(n^2)$ data; tiling turns that into arithmetic
#   intensity high enough to reach the compute roof, and grouped ordering turns neighbouring
#   programs' shared tiles into L2 hits.
# - A Triton program is one thread block on one SM: `num_warps` warps of 32 threads sharing
#   registers and shared memory. You write it in blocks, with offsets and masks; loads along the
#   stride-1 dimension coalesce.
# - Before CUDA a GPU multiplied matrices as render passes of a fragment shader, each output
#   fetching its own 2K texels; shared memory lets a tile's threads share their loads.
# - Tensor cores are where a modern GPU's FLOPs are; fp16, bf16 and TF32 are the ways in.
#   TF32 trades mantissa bits for speed and is opt-in in PyTorch, default in `tl.dot`.
#   They want M, N and K in multiples of 16 bytes, best 128 (fp16: 8 and 64): pad what you
#   choose, such as a vocabulary, and slice the padding off the result.
# - Tiles, `num_warps` and `num_stages` trade reuse against registers and shared memory, and so
#   against how many programs share an SM; the compiler reports the costs, the clock decides.
# - Compare against a tuned baseline, in the same precision, measured the same way — then
#   "100×" shrinks to what the hardware's roofs allow.
# - A convolution is a GEMM over im2col's columns, at the cost of `KH × KW` copies of its input;
#   implicit GEMM computes the columns' addresses inside the tiles' loads instead.
