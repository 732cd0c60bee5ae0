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
# 1. climb from three Python loops to a BLAS library and see how far apart they are;
# 2. write a **tiled Triton matmul kernel** *(graded: `matmul_fp32` 4 points, `matmul_fp16`
#    2 points, `matmul_speed` 2 points on GPU profiles)*;
# 3. implement the **grouped launch order** that makes tiles share the L2 cache *(graded:
#    `grouped_order`, 2 points)*;
# 4. meet tensor cores and TF32, place every version on the roofline, and compile your kernel
#    for real GPUs even if you do not have one.
#
# Without a GPU, Triton kernels run in the **Triton interpreter** (`TRITON_INTERPRET=1`, switched
# on by `fastdl_lab.device`): the same source, executed with NumPy on the CPU. It is exact enough
# to test correctness, and far too slow to say anything about speed.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import matplotlib.pyplot as plt
import numpy as np
import torch

from fastdl_lab import checks, gemm, measure, timing, triton_aot

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
# optimised, and measured the GPU at about **2.5× faster on average**. The large figures had
# typically compared a tuned GPU kernel against single-threaded, unvectorised CPU code.
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
# ## 3. Tiling: reuse every byte you load
#
# A GPU kernel that computed each $C_{ij}$ on its own would read a row of $A$ and a column of $B$
# for $2k$ FLOPs: 2 FLOPs per 2 loaded values, 0.25 FLOP/B in fp32 — deep in memory-bound
# territory. **Tiling** fixes this. Each Triton *program* (one instance of the kernel, run by a
# group of threads on one SM) computes a `BLOCK_M × BLOCK_N` tile of $C$. It walks along $K$ in
# steps of `BLOCK_K`, each time loading a `BLOCK_M × BLOCK_K` tile of $A$ and a
# `BLOCK_K × BLOCK_N` tile of $B$ into fast on-chip memory and multiplying them with `tl.dot`
# (which uses tensor cores). Per step it moves $(B_M + B_N) B_K$ values and performs
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
# them in the L2 cache. Section 5 arranges for that.
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
#    (`pid // num_pid_n, pid % num_pid_n`) is correct; the grouped order of section 5 is
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
    GROUP_M: tl.constexpr,
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
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    in_m = offs_m[:, None] < M
    in_n = offs_n[None, :] < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=in_m & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & in_n, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=in_m & in_n)
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
# ## 4. What your kernel compiles to
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
# The instruction's shape suffix says it all: a 64x128x16 tile, fp32 accumulator, fp16 inputs.
print(next(line.split()[0] for line in ptx.splitlines() if "wgmma.mma_async" in line))

# %% [markdown]
# ## 5. Grouped launch order
#
# A GPU runs as many programs at once as it has room for — roughly one per SM, 132 on an H100 —
# and they all want tiles of $A$ and $B$. With **row-major** order, consecutive programs compute
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
# ## 6. Tensor cores and TF32
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
# ## 7. Every version on the roofline
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
# ## 8. Speed
#
# The last graded item times your kernel against `torch.matmul` (cuBLAS) on a 4096³ fp16
# product, interleaved, on a GPU grading profile. Reaching cuBLAS is hard; getting within a
# small factor of it with forty lines of Triton is the point. On a CPU this cell only reports
# that the item needs a GPU: the autograder decides it.

# %% nbgrader={"grade_id": "matmul_speed", "grade": true, "points": 2}
import torch

from fastdl_lab import checks, device, gemm, timing

if device.has_gpu():
    _a = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=0)
    _b = checks.randn(4096, 4096, dtype=torch.float16, device="cuda", seed=1)
    _cmp = timing.compare(lambda: gemm.matmul(_a, _b, kernel=matmul_kernel), lambda: torch.matmul(_a, _b))
    print(f"your kernel vs torch.matmul: {_cmp.speedup:.2f}x (95% CI {_cmp.ci_low:.2f}-{_cmp.ci_high:.2f})")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## Summary
#
# - A matrix multiply does $O(n^3)$ work on $O(n^2)$ data; tiling turns that into arithmetic
#   intensity high enough to reach the compute roof, and grouped ordering turns neighbouring
#   programs' shared tiles into L2 hits.
# - Tensor cores are where a modern GPU's FLOPs are; fp16, bf16 and TF32 are the ways in.
#   TF32 trades mantissa bits for speed and is opt-in in PyTorch, default in `tl.dot`.
# - Compare against a tuned baseline, in the same precision, measured the same way — then
#   "100×" shrinks to what the hardware's roofs allow.
