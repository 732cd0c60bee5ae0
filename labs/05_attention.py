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
# # Lab 05 — FlashAttention: attention without the N×N matrix
#
# Attention compares every token with every other token, so the textbook implementation builds an
# $N \times N$ matrix of scores for each head of each layer. At $N = 8192$ that is 64 million
# entries per head, written to GPU memory, read back, written again as probabilities and read
# once more, then kept for the backward pass. FlashAttention (Dao et al., 2022; FlashAttention-2,
# Dao, 2023) computes exactly the same result without ever storing that matrix. In this lab you
# will:
#
# 1. count the bytes naive attention moves, and see why that, not arithmetic, sets its speed
#    *(sections 1–2, about 25 minutes of reading and running)*;
# 2. derive the **online softmax**, which normalises a row it has not finished reading, and
#    check it in plain PyTorch *(section 3, about 15 minutes)*;
# 3. write the whole algorithm in **plain PyTorch as an `autograd.Function`**: a forward over key
#    blocks that saves only the output and one logsumexp per row, and a backward that rebuilds the
#    probabilities block by block *(section 4, about 50 minutes; graded: `flash_torch`, 4 points)*;
# 4. write the same forward as a **Triton kernel** *(section 5, about 60 minutes; graded:
#    `attention_fwd`, 4 points)*;
# 5. write the **backward kernels**: the core is scaffolded, a kernel for $\delta$ and the loop body
#    of the $dK$/$dV$ kernel *(section 6a, about 40 minutes; graded: `attention_bwd`, 3 points)*;
#    the $dQ$ kernel, from its signature alone, is **optional** *(section 6b, about 30 minutes;
#    graded: `attention_bwd_dq`, 1 point)*: nothing else in the lab needs it;
# 6. measure what autograd keeps for the backward: quadratic for naive attention, linear for
#    yours *(section 7, about 15 minutes; graded: `attention_memory`, 2 points)*; see your kernels
#    compile to tensor-core instructions and, on a GPU, race PyTorch's own fused kernel *(sections
#    8–9, about 20 minutes; graded on GPU profiles: `attention_speed`, 2 points)*.
#
# The optional $dQ$ kernel adds about half an hour to the core path, whose time is stated below. The
# backward kernels are graded on the reference forward's output and logsumexp, so a slip in your
# forward kernel does not cost the backward's points, nor the core the optional part's.
#
# Without a GPU the kernels run in the Triton interpreter: correct, and far too slow to time.
#
# **Time:** about 3.75 hours for a student who has done the labs before it, by section in minutes:
# §1 10; §2 15; §3 15; §4 50; §5 60; §6 40; §7 15; §8 10; §9 10. The optional $dQ$ kernel (section
# 6b) adds about 30 minutes. Graded code regions take most of it; the estimates are the course's,
# not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import inspect

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from fastdl_lab import attention, checks, memory, timing, triton_aot

GPU = device.has_gpu()
DEV = "cuda" if GPU else "cpu"
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. What attention computes
#
# For one head, the $N$ tokens of a sequence carry a query $q_i$, a key $k_j$ and a value $v_j$,
# each a vector of $d$ numbers (the head dimension, usually 64 or 128). Stacked as $N \times d$
# matrices:
#
# $$S = \tau\, Q K^\top \in \mathbb{R}^{N\times N},\qquad P = \operatorname{softmax}_{\text{rows}}(S),\qquad
#   O = P V \in \mathbb{R}^{N\times d},$$
#
# with $\tau = 1/\sqrt{d}$ (`scale`). Row $i$ of $O$ is an average of the values, weighted by how
# well $q_i$ matches each key. In a decoder (GPT-style) model attention is **causal**: token $i$
# may only look at tokens $j \le i$, so $S_{ij} = -\infty$ above the diagonal. A real model runs
# this for every head of every sequence in the batch: tensors of shape
# `(batch, heads, tokens, head_dim)`, the layout of `F.scaled_dot_product_attention`.
#
# `attention.attention_ref` is the specification: it builds $S$ and $P$ in full, in fp32.

# %%
q, k, v = (checks.randn(2, 4, 256, 64, seed=i) for i in range(3))
o = attention.attention_ref(q, k, v, causal=True)
checks.assert_close(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))
print(f"q, k, v, o: {tuple(o.shape)}; scores: {2 * 4} matrices of {256}x{256}")
print("attention_ref matches F.scaled_dot_product_attention")

# %% [markdown]
# ## 2. Naive attention is bound by memory traffic
#
# Written as PyTorch operations, attention is three kernels: a matmul writes $S$, a softmax reads
# $S$ and writes $P$, a second matmul reads $P$ and $V$ and writes $O$
# (`attention.attention_naive`). Per head, in elements:
#
# | | reads | writes |
# |---|---|---|
# | $S = \tau QK^\top$ | $Q, K$: $2Nd$ | $S$: $N^2$ |
# | $P = \operatorname{softmax}(S)$ | $S$: $N^2$ | $P$: $N^2$ |
# | $O = PV$ | $P, V$: $N^2 + Nd$ | $O$: $Nd$ |
#
# That is $4N^2 + 4Nd$ elements for $4N^2d$ FLOPs (two products of $2N^2d$ each). In fp16, at
# large $N$, the arithmetic intensity is $4N^2d / 8N^2 = d/2$: **32 FLOP/B** for $d = 64$. An H100
# needs about 300 FLOP/B to keep its tensor cores busy (989 TFLOP/s over 3.35 TB/s), so the naive
# version waits on memory for roughly nine tenths of its run time, and the softmax in the middle
# (a few FLOPs per element, two $N^2$ passes) is pure traffic.
#
# A fused kernel that keeps each tile of $S$ and $P$ on chip moves only $Q, K, V$ in and $O$ out:
# $4Nd$ elements, an intensity of $N/2$ FLOP/B, far past the ridge for any real sequence.
# `attention.attention_bytes` does this bookkeeping (for the fused kernel it also charges one
# fp32 number per row, the logsumexp the backward needs; with `block_m=` it charges every query
# block a fresh read of $K$ and $V$, the bound when nothing stays in the L2 cache).

# %%
peak = device.PEAKS["h100"]
print(f"{'N':>6} {'naive MB':>10} {'flash MB':>9} {'no-L2 flash MB':>15}   naive / flash   "
      f"H100 datasheet lower bound, naive vs fused")
sizes = [512, 1024, 2048, 4096, 8192, 16384]
naive_mb, flash_mb = [], []
for n in sizes:
    naive_b = attention.attention_bytes(n, 64, 2, method="naive", batch_heads=16)
    flash_b = attention.attention_bytes(n, 64, 2, method="flash", batch_heads=16)
    no_l2_b = attention.attention_bytes(n, 64, 2, method="flash", batch_heads=16, block_m=128)
    flops = attention.attention_flops(n, 64, batch_heads=16)
    compute_s = flops / (peak.fp16_tflops * 1e12)
    naive_s = max(compute_s, naive_b / (peak.mem_bw_gbs * 1e9))
    flash_s = max(compute_s, flash_b / (peak.mem_bw_gbs * 1e9))
    naive_mb.append(naive_b / 1e6)
    flash_mb.append(flash_b / 1e6)
    print(f"{n:>6} {naive_b / 1e6:>10.1f} {flash_b / 1e6:>9.1f} {no_l2_b / 1e6:>15.1f}   {naive_b / flash_b:>13.0f}   "
          f"{naive_s * 1e6:8.0f} µs vs {flash_s * 1e6:6.0f} µs")
fig, ax = plt.subplots(figsize=(5.5, 3.5))
ax.loglog(sizes, naive_mb, "o-", label="naive: S and P through memory")
ax.loglog(sizes, flash_mb, "s-", label="fused: q, k, v in, o out")
ax.set_xlabel("sequence length N (16 heads, d = 64, fp16)")
ax.set_ylabel("MB moved, forward")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The lower bounds assume perfect overlap of compute and memory at datasheet rates; real kernels
# reach a fraction of them. The point is the shape: the naive time is the memory term, growing
# with $N^2$ bytes, while the fused kernel is limited by its arithmetic. The "no-L2" column is
# the FlashAttention paper's $\Theta(N^2 d^2 / M)$ analysis made concrete: even if every re-read
# of $K$ and $V$ went to memory, it moves several times fewer bytes than naive attention.
#
# A CPU has the same problem with its caches. PyTorch's CPU `scaled_dot_product_attention` is
# itself a tiled, fused kernel; here it races the three-kernel version on this machine:

# %%
for n in ([64, 256] if QUICK else [1024, 4096, 8192] if GPU else [256, 1024, 2048]):
    q, k, v = (checks.randn(1, 4, n, 64, seed=i, device=DEV) for i in range(3))
    cmp = timing.compare(lambda: F.scaled_dot_product_attention(q, k, v), lambda: attention.attention_naive(q, k, v),
                         reps=2 if QUICK else 5)
    scores_mb = 4 * n * n * 4 / 1e6
    print(f"N={n:>5}: naive {cmp.baseline.median * 1e3:7.2f} ms, fused {cmp.candidate.median * 1e3:7.2f} ms "
          f"({cmp.speedup:.1f}x); S alone is {scores_mb:.0f} MB")

# %% [markdown]
# While $S$ fits in the caches the two are close; once it does not (a few MB on this CPU), the
# naive version pays for the traffic. There is a second cost: to differentiate, autograd keeps
# $P$, one $N \times N$ matrix per head per layer, until the backward pass. For a model with 32
# heads at $N = 8192$ in fp16, that is 4 GiB **per layer**. Section 6 measures it.

# %% [markdown]
# ## 3. The online softmax
#
# The obstacle to tiling is the softmax. For a row $x$,
#
# $$\operatorname{softmax}(x)_j = \frac{e^{x_j - m}}{\ell},\qquad m = \max_j x_j,\qquad \ell = \sum_j e^{x_j - m}.$$
#
# (Subtracting the maximum changes nothing mathematically and keeps every exponential $\le 1$: no
# overflow, even in fp16.) Both $m$ and $\ell$ depend on the *whole* row, which seems to force one
# pass to find them and another to use them. The trick (Milakov and Gimelshein, 2018) is to keep
# them as running values. Suppose we have seen part of the row, with maximum $m$ and sum
# $\ell = \sum_{\text{seen}} e^{x_j - m}$, and a new block $B$ arrives. Its maximum may be larger:
#
# $$m' = \max\big(m, \max_{j\in B} x_j\big),\qquad
#   \ell' = \ell\, e^{m - m'} + \sum_{j \in B} e^{x_j - m'}.$$
#
# Multiplying by $e^{m-m'}$ re-expresses the old sum relative to the new maximum. Attention needs
# $\sum_j \operatorname{softmax}(x)_j\, v_j$, and the same correction works for an unnormalised
# running output:
#
# $$\mathrm{acc}' = \mathrm{acc}\; e^{m - m'} + \sum_{j\in B} e^{x_j - m'}\, v_j,
#   \qquad o = \mathrm{acc} / \ell \text{ at the end.}$$
#
# The division happens once, after the last block. At the end, $m + \log \ell$ is the row's
# **logsumexp** $\log\sum_j e^{x_j}$, one number that lets anyone rebuild any probability later:
# $P_{ij} = e^{S_{ij} - \mathrm{lse}_i}$. On one row of scores, block by block:

# %%
row = checks.randn(1000, seed=3, scale=4.0)
values = checks.randn(1000, 8, seed=4)
m, ell, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(8)
for chunk, chunk_v in zip(row.split(128), values.split(128)):
    m_next = torch.maximum(m, chunk.max())
    weights = torch.exp(chunk - m_next)
    ell = ell * torch.exp(m - m_next) + weights.sum()
    acc = acc * torch.exp(m - m_next) + weights @ chunk_v
    m = m_next
print(f"logsumexp: streamed {(m + torch.log(ell)).item():.6f}, exact {torch.logsumexp(row, 0).item():.6f}")
print(f"output:    largest difference {(acc / ell - torch.softmax(row, 0) @ values).abs().max().item():.1e}")

# %% [markdown]
# `attention.attention_tiled` applies this to attention in PyTorch: for each block of `block_m`
# query rows, it walks the keys `block_n` at a time, and a causal row block stops at the
# diagonal. Read it: your kernel is this loop nest, one query block per Triton program.

# %%
print(inspect.getsource(attention.attention_tiled))

# %%
q, k, v = (checks.randn(2, 3, 200, 64, seed=i, dtype=torch.float64) for i in range(3))
for causal in (False, True):
    out, lse = attention.attention_tiled(q, k, v, causal=causal, block_m=64, block_n=32, return_lse=True)
    checks.assert_close(out, attention.attention_ref(q, k, v, causal=causal))
    checks.assert_close(lse, attention.logsumexp_ref(q, k, causal=causal))
print("the tiled online softmax matches the reference, outputs and logsumexp, causal and not")

# %% [markdown]
# ## 4. FlashAttention in PyTorch: forward and backward
#
# `attention_tiled` never holds a whole row of probabilities, but it is forward only: run it
# under autograd and autograd records every tile's operations and keeps what each needs, which
# adds up to the $N \times N$ probabilities again. FlashAttention owns its backward: the forward
# saves $Q$, $K$, $V$, the output $O$ and **one logsumexp per row**, and the backward rebuilds
# the probabilities tile by tile. Before writing any of it in Triton, you will write it in plain
# PyTorch, where every intermediate can be printed, as a `torch.autograd.Function`.
#
# ### The backward pass
#
# Let $dO$ be the gradient arriving at the output. Going back through $O = PV$, the softmax and
# $S = \tau QK^\top$:
#
# $$dV = P^\top dO,\qquad dP = dO\, V^\top,\qquad dS_{ij} = P_{ij}\Big(dP_{ij} - \sum_l P_{il}\, dP_{il}\Big),
#   \qquad dQ = \tau\, dS\, K,\qquad dK = \tau\, dS^\top Q.$$
#
# The softmax step is its Jacobian, $\partial P_{ij}/\partial S_{il} = P_{ij}(\delta_{jl} - P_{il})$.
# Its row sum simplifies: $\sum_l P_{il}\,dP_{il} = \sum_l P_{il} \sum_c dO_{ic} V_{lc} =
# \sum_c dO_{ic}\, O_{ic}$. So
#
# $$\delta_i = \sum_c dO_{ic}\, O_{ic},\qquad dS = P \circ (dP - \delta),$$
#
# one number per row, from two $N \times d$ tensors: no $N \times N$ reduction. And $P$ itself is
# never stored: $P_{ij} = \exp(\tau\,q_i\cdot k_j - \mathrm{lse}_i)$ rebuilds any tile exactly,
# already normalised, from $Q$, $K$ and the saved logsumexp. Recomputing the scores costs one
# extra matmul per tile; storing them would cost the $N^2$ traffic and memory we set out to avoid.
# The formulas, against autograd, in fp64:

# %%
qd, kd, vd = (checks.randn(1, 2, 50, 16, seed=i, dtype=torch.float64).requires_grad_() for i in range(3))
grad_out = checks.randn(1, 2, 50, 16, seed=9, dtype=torch.float64)
tau = 16**-0.5
auto = torch.autograd.grad(attention.attention_ref(qd, kd, vd, causal=True), (qd, kd, vd), grad_out)
with torch.no_grad():
    lse_d = attention.logsumexp_ref(qd, kd, causal=True)
    probs = torch.exp(tau * qd @ kd.transpose(-1, -2) - lse_d[..., None]).tril()
    out_d = probs @ vd
    delta_d = (grad_out * out_d).sum(-1, keepdim=True)
    d_scores = probs * (grad_out @ vd.transpose(-1, -2) - delta_d)
    manual = (tau * d_scores @ kd, tau * d_scores.transpose(-1, -2) @ qd, probs.transpose(-1, -2) @ grad_out)
for label, a, b in zip(("dq", "dk", "dv"), manual, auto):
    print(f"{label}: largest difference from autograd {(a - b).abs().max().item():.1e}")

# %% [markdown]
# ### Your `FlashAttentionTorch`
#
# Write `forward` and `backward` below. The forward takes every query at once and walks the keys
# `block_n` at a time, exactly like the inner loop of `attention_tiled`; the backward walks the
# same key blocks. For each block $j$ (keys $j_0 \dots j_0 + $ `block_n` $- 1$):
#
# $$S_j = \tau\, Q K_j^\top,\quad P_j = e^{S_j - \mathrm{lse}},\quad dV_j = P_j^\top dO,\quad
#   dS_j = P_j \circ (dO\, V_j^\top - \delta),\quad dQ \mathrel{+}= \tau\, dS_j K_j,\quad dK_j = \tau\, dS_j^\top Q.$$
#
# $dV_j$ and $dK_j$ belong to block $j$ alone, so each is written once into its rows of `dv` and
# `dk`; $dQ$ sums over every block. The contract:
#
# - `q`, `k`, `v`: `(batch, heads, N, d)`, fp32, as many keys as queries (write it with `...` for
#   the leading dimensions and it works for any number of them); $\tau = 1/\sqrt d$ (`scale`,
#   given); `block_n` is any positive number, usually not a divisor of $N$: the last block is short;
# - `causal`: key $j$ is masked for query $i$ when $j > i$. Build the mask **per block**, from
#   `rows` (given) and this block's key positions (`torch.arange(j0, j0 + size)`): a mask of all
#   $N \times N$ positions is an $N \times N$ tensor too;
# - `forward` saves `ctx.save_for_backward(q, k, v, o, lse)` and nothing else of size $N$ or more
#   (`ctx.causal = causal` and `ctx.block_n = block_n` are fine), and returns `o` in `q`'s dtype;
# - `backward` gets `do` and returns `dq, dk, dv, None, None`: one gradient per `forward` input,
#   `None` for `causal` and `block_n`.
#
# How it is graded (`flash_torch`, 4 points). Half: the output and all three gradients against
# fp64 attention on hidden shapes, causal and not, with `block_n` dividing $N$ or not. Half:
# **memory**, on one more causal forward and backward at $N = 8192$ ($d = 16$, `block_n` 64), where
# a single $N \times N$ fp32 matrix is 256 MiB and $Q$, $K$, $V$ are 512 KiB each. Its output and
# gradients are checked like the others, and its memory is the **peak** the operating system
# counted for the whole process your code runs in (its memory cgroup: every thread and helper
# process, whatever holds the bytes), against the same call with the course's implementation:
# yours may be at most 64 MiB higher. Saving or keeping anything $N \times N$ anywhere, or creating
# it even for a moment (a full mask is 64 MiB of booleans, and the `triu` that makes it more),
# loses this half, with the figures named. What your own process counts on a call at $N = 512$
# (`memory.footprint` below: saved, kept, largest tensor) comes with the reason as a hint, not a
# score. The grader runs only this cell's classes and functions, with `math`, `torch` and `F`
# (`torch.nn.functional`) available: imports inside them, library attention
# (`F.scaled_dot_product_attention`), NumPy, lists of numbers and other processes are refused.

# %% nbgrader={"grade_id": "attn_torch_code", "solution": true}
import math

import torch


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        # The running state is fp32 whatever the inputs' dtype.
        qf, kf, vf = q.float(), k.float(), v.float()
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[-2], k.shape[-2]
        rows = torch.arange(n_q, device=q.device)
        ### BEGIN SOLUTION
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), device=q.device)
        for j0 in range(0, n_k, block_n):
            k_j, v_j = kf[..., j0:j0 + block_n, :], vf[..., j0:j0 + block_n, :]
            s = (qf @ k_j.transpose(-2, -1)) * scale
            if causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + p @ v_j
            m = m_new
        o = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.block_n = causal, block_n
        return o.to(q.dtype)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
        scale = q.shape[-1] ** -0.5
        rows = torch.arange(q.shape[-2], device=q.device)
        ### BEGIN SOLUTION
        block_n = ctx.block_n
        delta = (dof * o).sum(-1)
        dq = torch.zeros_like(qf)
        dk, dv = torch.empty_like(kf), torch.empty_like(vf)
        for j0 in range(0, k.shape[-2], block_n):
            k_j, v_j = kf[..., j0:j0 + block_n, :], vf[..., j0:j0 + block_n, :]
            s = (qf @ k_j.transpose(-2, -1)) * scale
            if ctx.causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            p = torch.exp(s - lse[..., None])
            dv[..., j0:j0 + block_n, :] = p.transpose(-2, -1) @ dof
            ds = p * (dof @ v_j.transpose(-2, -1) - delta[..., None])
            dq += (ds @ k_j) * scale
            dk[..., j0:j0 + block_n, :] = (ds.transpose(-2, -1) @ qf) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
        ### END SOLUTION


# %%
def flash_torch(q, k, v, causal=False, block_n=64):
    """``attention.flash_attention_torch`` with your FlashAttentionTorch."""
    return attention.flash_attention_torch(q, k, v, causal=causal, block_n=block_n, function=FlashAttentionTorch)


# %% [markdown]
# `memory.footprint(fn, q, k, v)` runs one forward and backward and counts, from inside the
# process, what the memory peak is made of. Against `attention_ref`, which lets autograd record its operations, and
# `attention_tiled`, whose tiles autograd records one by one (small tensors, $N \times N$ in all):

# %%
for n in ([128, 256] if QUICK else [256, 512, 1024]):
    q, k, v = (checks.randn(1, 1, n, 64, seed=i, device=DEV).requires_grad_() for i in range(3))
    for label, fn in (("attention_ref", lambda *t: attention.attention_ref(*t, causal=True)),
                      ("attention_tiled", lambda *t: attention.attention_tiled(*t, causal=True)),
                      ("yours", lambda *t: flash_torch(*t, causal=True, block_n=64))):
        _, _, fig = memory.footprint(fn, q, k, v)
        print(f"N={n:>5} {label:>15}: saved {fig.saved_bytes / 2**10:7.0f} KiB, kept after the forward "
              f"{fig.kept_bytes / 2**10:6.0f} KiB, largest tensor {fig.largest_shape}")

# %% nbgrader={"grade_id": "flash_torch", "grade": true, "points": 4}
import torch

from fastdl_lab import attention, checks, device, memory

_dev = "cuda" if device.has_gpu() else "cpu"


def _torch_case(shape, causal, block_n, seed):
    q, k, v = (checks.randn(shape, seed=seed + i, device=_dev).requires_grad_() for i in range(3))
    do = checks.randn(shape, seed=seed + 3, device=_dev)
    o = flash_torch(q, k, v, causal=causal, block_n=block_n)
    label = f"{shape}, causal={causal}, block_n={block_n}"
    attention.check_attention(o, q.detach(), k.detach(), v.detach(), causal, name=f"o for {label}")
    grads = torch.autograd.grad(o, (q, k, v), do)
    attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal, name=label)


def _torch_footprint(n, d=32, block_n=32):
    figures = []
    for size in (n, 2 * n):
        q, k, v = (checks.randn(1, 1, size, d, seed=650 + i, device=_dev).requires_grad_() for i in range(3))
        figures.append(memory.footprint(lambda *t: flash_torch(*t, causal=True, block_n=block_n), q, k, v)[2])
    small, large = figures
    scores = (2 * n) ** 2 * 4
    for key in ("saved_bytes", "kept_bytes", "python_bytes"):
        assert getattr(large, key) < scores, f"{key}: {getattr(large, key)} at N={2 * n}, an N x N matrix is {scores}"
    for key in ("saved_bytes", "kept_bytes"):
        assert getattr(large, key) <= 2 * getattr(small, key) + 256, f"{key} grows faster than N"
    for size, fig in ((n, small), (2 * n, large)):
        assert fig.largest_elements < size * size, (
            f"the {fig.largest_phase} created a tensor of shape {fig.largest_shape} at N={size}: not tiled")
    return large


# One token; ragged against the block; several blocks, causal and not.
for _causal in (False, True):
    for _shape, _bn in [((1, 1, 1, 16), 16), ((1, 2, 37, 16), 16), ((2, 1, 100, 32), 32)]:
        _torch_case(_shape, _causal, _bn, seed=80)
_fig = _torch_footprint(128)
print(f"flash_torch: visible tests passed (at N=256: {_fig.saved_bytes} bytes saved, "
      f"largest tensor {_fig.largest_shape})")
### BEGIN HIDDEN TESTS
for _causal in (True, False):
    for _shape, _bn in [((1, 2, 70, 32), 64), ((2, 2, 45, 16), 8), ((1, 1, 64, 32), 16)]:
        _torch_case(_shape, _causal, _bn, seed=90)
_torch_footprint(256)
### END HIDDEN TESTS

# %% [markdown]
# ## 5. The forward kernel
#
# Write `attn_fwd_kernel` with exactly the signature below. `flash(q, k, v,
# causal=..., kernels={"fwd": attn_fwd_kernel})` (the launcher `attention.flash_attention` with the
# autograd wiring you write just below the kernel) prepares everything:
#
# - the `(batch, heads, N, D)` inputs are viewed as `Z = batch * heads` **slices** of `N` rows of
#   `HEAD_DIM` contiguous elements. Element `(z, row, d)` of `q`, `k`, `v` and `o` is at
#   `z * stride_z + row * stride_row + d` (all four share the strides);
# - `lse` is fp32, `Z × N`, contiguous: row `i` of slice `z` is at `z * N + i`. Store the natural
#   logsumexp $\log\sum_j e^{\tau q_i\cdot k_j}$ (over the keys row `i` may see);
# - the grid is `(cdiv(N, BLOCK_M), Z)`: `tl.program_id(0)` is the query block,
#   `tl.program_id(1)` the slice; `scale` is $\tau$; `CAUSAL`, `BLOCK_M`, `BLOCK_N` and `HEAD_DIM`
#   are compile-time constants (powers of two, at least 16). On the CPU the blocks are 64 unless a
#   test forces others; `N` is any length, often not a multiple of either block;
# - on the CPU `o` and `lse` start filled with NaN: a row you forget to write fails the check.
#
# Your kernel:
#
# 1. loads its `BLOCK_M × HEAD_DIM` tile of `q` (mask the rows past `N`), and starts the running
#    state: `m` at $-\infty$, `l` at 0, an fp32 `BLOCK_M × HEAD_DIM` accumulator at 0;
# 2. loops over key blocks, `range(0, hi, BLOCK_N)`, with `hi = N`, or for causal attention the
#    end of this query block (`tl.minimum(N, (pid + 1) * BLOCK_M)`): later keys are masked for
#    every row of the block. Each step loads a `k` and a `v` tile (masked), computes the scores
#    with `tl.dot` (you need $q\,k^\top$: load `k` as a `HEAD_DIM × BLOCK_N` tile by swapping the
#    roles of the offsets, or use `tl.trans`), sets masked scores to `-inf` (keys past `N`; for
#    causal attention also keys after the query), and updates `m`, `l` and the accumulator;
# 3. stores `o = acc / l` in `o`'s element type (`o_ptr.dtype.element_ty`) and the logsumexp.
#
# Details that matter:
#
# - `tl.dot` takes tiles of the inputs' type and accumulates in fp32. Cast the probability tile
#   to `v`'s type before the second product (`p.to(v.dtype)`), as every FlashAttention does: on
#   a GPU that keeps both products on the fp16 tensor cores.
# - Every row, padded or not, sees key 0 in the first block, so after the first step `m` is
#   finite and $e^{-\infty - m} = 0$ is clean. (`tl.exp(-inf - (-inf))` would be NaN.)
# - Optional, and what real kernels do: $e^x = 2^{x\log_2 e}$, and `exp2` is the GPU's native
#   instruction. Multiply `scale` by $\log_2 e = 1.4426950408889634$ once, use `tl.exp2`, and
#   divide the logsumexp by $\log_2 e$ before storing it.
# - Masking every key block, as described above, is correct and is all the grader asks for. The
#   package's reference kernel goes further and masks only the blocks that need it: section 8
#   shows how, and what it saves on a GPU.

# %% nbgrader={"grade_id": "attn_fwd_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_rows = offs_m < N
    q = tl.load(q_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], mask=in_rows[:, None], other=0.0)

    qk_scale = scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_keys = offs_n < N
        k_t = tl.load(k_ptr + base + offs_n[None, :] * stride_row + offs_d[:, None], mask=in_keys[None, :], other=0.0)
        v = tl.load(v_ptr + base + offs_n[:, None] * stride_row + offs_d[None, :], mask=in_keys[:, None], other=0.0)
        s = tl.dot(q, k_t) * qk_scale
        valid = in_keys[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        correction = tl.exp2(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new

    o = acc / l_i[:, None]
    tl.store(o_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=in_rows[:, None])
    tl.store(lse_ptr + z * N + offs_m, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=in_rows)
    ### END SOLUTION


# %% [markdown]
# ### Wiring your kernels into autograd
#
# Before testing, put your kernels behind a `torch.autograd.Function`. Its `forward` receives the
# inputs as `(B·H, N, D)` contiguous views and the launch configuration, runs the forward kernel
# through `attention.launch_forward(kernel, q3, k3, v3, causal, scale, config)` (which returns
# `o` and the fp32 logsumexp), and decides **what autograd keeps for the backward**: that choice
# is the whole memory story of this lab, and the `attention_memory` item measures it. The
# `backward` gets `dO` (make it contiguous: the gradient of `o.sum()` has stride 0 everywhere),
# runs `attention.launch_backward(kernels, q3, k3, v3, o3, lse, do3, causal, scale, config)`, and
# returns one gradient per `forward` input (`None` for the non-tensors). `flash(...)` below passes
# your class to the package's launcher, which validates the inputs and picks the tiles.
#
# The grader takes only the classes and functions of this cell, beside your forward kernel, and
# runs them with `torch` and `attention` as the only names: no imports inside them, no
# `getattr`/`eval`, no `_private` attributes of other objects, no assignments to attributes of
# anything but `self` and `ctx`. Whatever else the cell does at its top level does not reach it.
#
# How `attention_memory` (2 points) is graded: your kernel and this class run a small ragged case,
# then one causal forward and backward at $N = 8192$ (one head, $d = 16$, $512 \times 512$ tiles),
# where a single $N \times N$ fp32 matrix is 256 MiB. The outputs and gradients must be right, and
# the **peak memory** the operating system counted for the whole process (its memory cgroup:
# every thread and helper process, whatever holds the bytes) may be at most 64 MiB above the same
# calls with the course's kernel and wiring. In the grader, `attention.launch_backward` runs
# PyTorch's own FlashAttention backward for the CPU in place of the backward kernels (yours are
# graded by `attention_bwd`): your backward must hand it the tensors your forward saved, and your
# kernel's logsumexp must be the natural one section 5 asks for. It runs on the CPU on every
# machine; on a GPU the allocator's peak is printed below, not graded. The saved bytes your
# process counts itself are only a hint in the grader's reason.

# %% nbgrader={"grade_id": "attn_function_code", "solution": true}
import torch

from fastdl_lab import attention


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernels, config):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
        ### BEGIN SOLUTION
        o3, lse = attention.launch_forward(kernels["fwd"], q3, k3, v3, causal, scale, config)
        ctx.save_for_backward(q3, k3, v3, o3, lse)
        ctx.causal, ctx.scale, ctx.kernels, ctx.config = causal, scale, kernels, config
        return o3.view(q.shape)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        ### BEGIN SOLUTION
        q3, k3, v3, o3, lse = ctx.saved_tensors
        do3 = do.contiguous().view(o3.shape)
        grads = attention.launch_backward(ctx.kernels, q3, k3, v3, o3, lse, do3, ctx.causal, ctx.scale, ctx.config)
        return (*(g.view(do.shape) for g in grads), None, None, None, None)
        ### END SOLUTION


def flash(q, k, v, **options):
    """``attention.flash_attention`` with your autograd wiring."""
    return attention.flash_attention(q, k, v, function=FlashAttention, **options)


# %% nbgrader={"grade_id": "attention_fwd", "grade": true, "points": 4}
import torch

from fastdl_lab import attention, checks, device

_dev = "cuda" if device.has_gpu() else "cpu"


def _fwd(shape, dtype, causal, block_m, block_n, seed, spread=1.0, scale=None):
    q, k, v = (checks.randn(shape, dtype=dtype, seed=seed + i, device=_dev, scale=spread) for i in range(3))
    o = flash(q, k, v, causal=causal, scale=scale, kernels={"fwd": attn_fwd_kernel},
                                  block_m=block_m, block_n=block_n)
    attention.check_attention(o, q, k, v, causal, scale=scale,
                              name=f"o for {shape}, {dtype}, causal={causal}, blocks {block_m}x{block_n}")


# One token; ragged inside one tile; ragged over several tiles of both sizes; head dims 32 and 64.
for _dtype in (torch.float32, torch.float16):
    for _causal in (False, True):
        for _shape, _bm, _bn in [((1, 1, 1, 32), None, None), ((1, 2, 37, 64), 32, 32), ((2, 1, 100, 32), 32, 64)]:
            _fwd(_shape, _dtype, _causal, _bm, _bn, seed=100)
print("attention_fwd: visible tests passed")
### BEGIN HIDDEN TESTS
for _dtype in (torch.float16, torch.float32):
    for _causal in (True, False):
        for _shape, _bm, _bn in [((1, 2, 130, 64), 64, 32), ((2, 2, 64, 32), 32, 32), ((1, 1, 150, 64), None, None),
                                 ((1, 1, 17, 32), 16, 16)]:
            _fwd(_shape, _dtype, _causal, _bm, _bn, seed=200)
_fwd((1, 1, 70, 128), torch.float16, True, 32, 64, seed=300)
_fwd((1, 2, 90, 32), torch.float32, False, 32, 32, seed=301, spread=5.0)
_fwd((1, 2, 90, 64), torch.float16, True, 64, 16, seed=302, spread=2.0, scale=0.3)
_qkv = checks.randn(2, 50, 3, 2, 32, seed=303, device=_dev)
_q, _k, _v = (_qkv[:, :, i].transpose(1, 2) for i in range(3))
_o = flash(_q, _k, _v, causal=True, kernels={"fwd": attn_fwd_kernel}, block_m=16, block_n=32)
attention.check_attention(_o, _q, _k, _v, True, name="o for strided views of a fused qkv projection")
### END HIDDEN TESTS

# %% [markdown]
# ## 6. The backward kernels
#
# The kernels compute what your `FlashAttentionTorch.backward` computes, one tile at a time: the
# same $P = e^{\tau QK^\top - \mathrm{lse}}$ rebuilt from $Q$, $K$ and the saved logsumexp, the
# same $\delta = \operatorname{rowsum}(dO \circ O)$, the same five products. What changes is who
# computes what.
#
# ### Splitting the work without atomics
#
# $dK_j$ and $dV_j$ sum over every query that sees key $j$; $dQ_i$ sums over every key that query
# $i$ sees. A program that owns a block of keys can loop over the query blocks and accumulate its
# $dK$ and $dV$ tiles in registers, but then its contributions to $dQ$ land in rows that every
# other key-block program also writes: that needs atomic additions (contended, and a different
# summation order on every run). Instead, three kernels, where every output address has exactly
# one writer:
#
# 1. `attn_bwd_preprocess_kernel`: $\delta$ for `BLOCK_M` rows (grid `(cdiv(N, BLOCK_M), Z)`);
# 2. `attn_bwd_dkdv_kernel`: one program per key block (grid `(cdiv(N, BLOCK_N), Z)`), looping
#    over the query blocks: recompute $P^\top$ for the tile, $dV \mathrel{+}= P^\top dO$,
#    $dP^\top = V\,dO^\top$, $dS^\top = P^\top \circ (dP^\top - \delta)$, $dK \mathrel{+}= dS^\top Q$;
#    multiply $dK$ by $\tau$ at the end;
# 3. `attn_bwd_dq_kernel`: one program per query block (grid `(cdiv(N, BLOCK_M), Z)`), looping
#    over the key blocks: recompute $P$, $dP = dO\,V^\top$, $dS$, $dQ \mathrel{+}= dS\,K$; times $\tau$.
#
# The price is recomputing the score tile in both kernels: seven tile products instead of five.
# Layouts as in the forward: `q`, `k`, `v`, `do`, `dq`, `dk`, `dv` share `stride_z` and
# `stride_row`; `lse` and `delta` are fp32 `Z × N`. The gradients start as NaN on the CPU.
#
# ### 6a. The core: $\delta$ and the dK/dV kernel (graded `attention_bwd`, 3 points)
#
# Write `attn_bwd_preprocess_kernel` whole (a masked load of an `o` and a `do` tile, one row sum,
# a masked store: it is the forward's first and last lines). In `attn_bwd_dkdv_kernel` the
# program's setup, its loads, the loop over query blocks and the stores are written for you; write
# the body of the loop. The tile is transposed, keys down and queries across, so that $dV$ and
# $dK$ are plain products of a tile with rows of `do` and `q`:
#
# 1. `s_t = tl.dot(k, tl.trans(q)) * qk_scale`: `BLOCK_N × BLOCK_M` scores, in base-2 units
#    (`qk_scale` already holds $\tau \log_2 e$);
# 2. mask them: queries past `N` (`in_rows`) and, for causal attention, queries before the key
#    (`offs_m[None, :] >= offs_n[:, None]` is where a score is kept). A masked score becomes
#    `-inf` **before** the exponential: it was never part of the row's logsumexp and may exceed
#    it, so its exponential could overflow;
# 3. `p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)`: the probabilities, transposed;
# 4. `dv += P^T dO`, then `dp_t = V dO^T`, `ds_t = p_t * (dp_t - delta[None, :])`, `dk += dS^T Q`.
#    Accumulate with `tl.dot(a, b, acc)`, casting `p_t` and `ds_t` to the inputs' type first (they
#    are fp32; on a GPU the products run on the fp16 tensor cores).
#
# The graded test feeds your two kernels the reference forward's `o` and logsumexp
# (`attention.backward_parts`), so they are judged on their own, not through your forward kernel.
# With fp32 inputs on a GPU that forward takes its scores in TF32, as your kernels' `tl.dot` does
# there: step 3 rebuilds exact probabilities only from the lse of the same scores.

# %% nbgrader={"grade_id": "attn_bwd_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_bwd_preprocess_kernel(o_ptr, do_ptr, delta_ptr, stride_z, stride_row, N,
                               BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_rows = offs_m < N
    offs = z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :]
    o = tl.load(o_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs, mask=in_rows[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + z * N + offs_m, tl.sum(o * do, axis=1), mask=in_rows)
    ### END SOLUTION


@triton.jit
def attn_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, stride_z, stride_row,
                         N, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr):
    pid_n = tl.program_id(0)
    z = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_keys = offs_n < N
    kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
    k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    # Causal: queries before this key block cannot see it; start at the query block holding the
    # block's first key.
    if CAUSAL:
        lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    for start_m in range(lo, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_rows = offs_m < N
        q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
        lse = tl.load(lse_ptr + z * N + offs_m, mask=in_rows, other=0.0)
        delta = tl.load(delta_ptr + z * N + offs_m, mask=in_rows, other=0.0)
        ### BEGIN SOLUTION
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        valid = in_rows[None, :]
        if CAUSAL:
            valid = valid & (offs_m[None, :] >= offs_n[:, None])
        p_t = tl.exp2(tl.where(valid, s_t, float("-inf")) - lse[None, :] * 1.4426950408889634)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        ### END SOLUTION

    tl.store(dk_ptr + kv_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=in_keys[:, None])
    tl.store(dv_ptr + kv_offs, dv.to(dv_ptr.dtype.element_ty), mask=in_keys[:, None])


# %% nbgrader={"grade_id": "attention_bwd", "grade": true, "points": 3}
import torch

from fastdl_lab import attention, checks, device

_dev = "cuda" if device.has_gpu() else "cpu"
_core = {"bwd_preprocess": attn_bwd_preprocess_kernel, "bwd_dkdv": attn_bwd_dkdv_kernel}


def _bwd(kernels, shape, dtype, causal, block_m, block_n, seed, spread=1.0):
    q, k, v = (checks.randn(shape, dtype=dtype, seed=seed + i, device=_dev, scale=spread) for i in range(3))
    do = checks.randn(shape, dtype=dtype, seed=seed + 3, device=_dev)
    grads = attention.backward_parts(q, k, v, do, kernels, causal=causal, block_m=block_m, block_n=block_n)
    attention.check_attention_grads(grads, q, k, v, do, causal,
                                    name=f"{shape}, {dtype}, causal={causal}, blocks {block_m}x{block_n}:")


# Ragged lengths over several tiles, head dims 32 and 64, causal and not; one fp16 case.
for _causal in (False, True):
    for _shape, _bm, _bn in [((1, 1, 1, 32), None, None), ((1, 2, 37, 64), 32, 32), ((2, 1, 100, 32), 32, 64)]:
        _bwd(_core, _shape, torch.float32, _causal, _bm, _bn, seed=400)
_bwd(_core, (1, 2, 70, 64), torch.float16, True, 32, 32, seed=410)
print("attention_bwd: visible tests passed (dK and dV)")
### BEGIN HIDDEN TESTS
for _causal in (True, False):
    for _shape, _bm, _bn in [((1, 2, 130, 64), 64, 32), ((2, 2, 64, 32), 32, 32), ((1, 1, 150, 64), None, None),
                             ((1, 1, 17, 32), 16, 16)]:
        _bwd(_core, _shape, torch.float32, _causal, _bm, _bn, seed=500)
    _bwd(_core, (1, 2, 100, 32), torch.float16, _causal, 32, 64, seed=510)
_bwd(_core, (1, 1, 60, 128), torch.float32, True, 32, 16, seed=520)
_bwd(_core, (1, 2, 80, 32), torch.float32, False, 16, 32, seed=530, spread=4.0)
### END HIDDEN TESTS

# %% [markdown]
# ### 6b. Optional: the dQ kernel (graded `attention_bwd_dq`, 1 point)
#
# This part is optional: skip it if you are short of time. Nothing else in the lab needs it; the
# cells below that would use your whole backward say so and carry on without it.
#
# Write `attn_bwd_dq_kernel` from its signature alone, with the dK/dV kernel as your model: one
# program per block of `BLOCK_M` queries (`tl.program_id(0)`) of slice `tl.program_id(1)`, which
# loads its `q`, `do`, `lse` and `delta` once, loops over the key blocks (for causal attention, up
# to the end of its own query block, as the forward does), recomputes the `BLOCK_M × BLOCK_N` tile
# of $P$ (not transposed this time), and accumulates $dQ \mathrel{+}= dS\,K$ with
# $dS = P \circ (dO\,V^\top - \delta)$; it stores $\tau\, dQ$ in `dq_ptr`'s element type. It is
# graded with the reference's $\delta$, so it does not depend on your preprocess kernel.

# %% nbgrader={"grade_id": "attn_bwd_dq_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr):
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    in_rows = offs_m < N
    q_offs = base + offs_m[:, None] * stride_row + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=in_rows[:, None], other=0.0)
    do = tl.load(do_ptr + q_offs, mask=in_rows[:, None], other=0.0)
    lse = tl.load(lse_ptr + z * N + offs_m, mask=in_rows, other=0.0)
    delta = tl.load(delta_ptr + z * N + offs_m, mask=in_rows, other=0.0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634

    if CAUSAL:
        hi = tl.minimum(N, (pid_m + 1) * BLOCK_M)
    else:
        hi = N
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_keys = offs_n < N
        kv_offs = base + offs_n[:, None] * stride_row + offs_d[None, :]
        k = tl.load(k_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=in_keys[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = in_keys[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None])
        p = tl.exp2(tl.where(valid, s, float("-inf")) - lse[:, None] * 1.4426950408889634)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)

    tl.store(dq_ptr + q_offs, (dq * scale).to(dq_ptr.dtype.element_ty), mask=in_rows[:, None])
    ### END SOLUTION


# %% nbgrader={"grade_id": "attention_bwd_dq", "grade": true, "points": 1}
import torch

from fastdl_lab import attention, checks, device

_dev = "cuda" if device.has_gpu() else "cpu"
_optional = {"bwd_dq": attn_bwd_dq_kernel}


def _dq(shape, dtype, causal, block_m, block_n, seed):
    q, k, v = (checks.randn(shape, dtype=dtype, seed=seed + i, device=_dev) for i in range(3))
    do = checks.randn(shape, dtype=dtype, seed=seed + 3, device=_dev)
    grads = attention.backward_parts(q, k, v, do, _optional, causal=causal, block_m=block_m, block_n=block_n)
    attention.check_attention_grads(grads, q, k, v, do, causal,
                                    name=f"{shape}, {dtype}, causal={causal}, blocks {block_m}x{block_n}:")


if attention.kernel_written(attn_bwd_dq_kernel):
    for _causal in (False, True):
        for _shape, _bm, _bn in [((1, 1, 1, 32), None, None), ((1, 2, 37, 64), 32, 32), ((2, 1, 100, 32), 32, 64)]:
            _dq(_shape, torch.float32, _causal, _bm, _bn, seed=440)
    _dq((1, 2, 70, 64), torch.float16, True, 32, 32, seed=450)
    print("attention_bwd_dq: visible tests passed (dQ)")
else:
    print("attention_bwd_dq: the optional dQ kernel is not written yet; skipped")
### BEGIN HIDDEN TESTS
for _causal in (True, False):
    for _shape, _bm, _bn in [((1, 2, 130, 64), 64, 32), ((2, 2, 64, 32), 32, 32), ((1, 1, 17, 32), 16, 16)]:
        _dq(_shape, torch.float32, _causal, _bm, _bn, seed=560)
    _dq((1, 2, 100, 32), torch.float16, _causal, 32, 64, seed=570)
### END HIDDEN TESTS

# %% [markdown]
# With all four kernels, your `FlashAttention` class trains: the gradient of a loss flows through
# your forward kernel, then your three backward kernels.

# %%
_all = {"fwd": attn_fwd_kernel, "bwd_preprocess": attn_bwd_preprocess_kernel, "bwd_dkdv": attn_bwd_dkdv_kernel,
        "bwd_dq": attn_bwd_dq_kernel}
if attention.kernel_written(attn_bwd_dq_kernel):
    qs, ks, vs = (checks.randn(1, 2, 40, 32, seed=540 + i, device=DEV).requires_grad_() for i in range(3))
    flash(qs, ks, vs, causal=True, kernels=_all, block_m=16, block_n=16).sum().backward()
    attention.check_attention_grads((qs.grad, ks.grad, vs.grad), qs.detach(), ks.detach(), vs.detach(),
                                    torch.ones(1, 2, 40, 32, device=DEV), True, name="gradient of a sum:")
    print("forward and backward kernels together: the gradients of a sum match")
else:
    print("skipped: needs the optional dQ kernel")

# %% [markdown]
# ## 7. Wiring into autograd, and what it keeps
#
# Your `FlashAttention` decides what autograd keeps. The backward kernels recompute every score
# tile from $Q$, $K$ and the logsumexp, so $Q$, $K$, $V$, $O$ and one fp32 number a row are all
# it needs: nothing of size $N \times N$. Saving the scores or the probabilities "to save time"
# would bring back exactly the quadratic memory this lab removes.

# %% [markdown]
# `memory.saved_tensor_bytes(fn, *inputs)` counts the bytes autograd keeps for the backward while
# `fn` runs: every tensor saved for backward, each storage once. For the reference, which lets
# autograd record its three operations, that includes $P$; for your kernels, only $N \times d$
# tensors and one fp32 number a row. Exact figures, the same on every machine:

# %%
lengths = [64, 128] if QUICK else [64, 128, 256, 512, 1024]
saved = {"naive (attention_ref)": [], "flash (your kernels)": []}
for n in lengths:
    q, k, v = (checks.randn(1, 1, n, 64, seed=i, device=DEV).requires_grad_() for i in range(3))
    saved["naive (attention_ref)"].append(memory.saved_tensor_bytes(attention.attention_ref, q, k, v))
    saved["flash (your kernels)"].append(memory.saved_tensor_bytes(
        lambda *t: flash(*t, kernels={"fwd": attn_fwd_kernel}), q, k, v))
for label, figures in saved.items():
    print(f"{label:>22}: " + ", ".join(f"{b / 2**10:.0f} KiB" for b in figures))
fig, ax = plt.subplots(figsize=(5.5, 3.5))
for (label, figures), marker in zip(saved.items(), "os"):
    ax.loglog(lengths, [b / 2**20 for b in figures], marker + "-", label=label)
ax.set_xlabel("sequence length N (one head, d = 64, fp32)")
ax.set_ylabel("MiB saved for backward")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# On a log-log plot the slope is the exponent: 2 for naive attention once $N^2$ dominates $3Nd$,
# 1 for yours. On a GPU, `memory.peak_memory_bytes` measures the same effect in the allocator's
# peak during a full forward and backward:

# %%
if not GPU:
    print("needs a GPU: the CPU allocator keeps no peak; the saved-tensor bytes above are the figure")
elif not attention.kernel_written(attn_bwd_dq_kernel):
    print("skipped: a full backward needs the optional dQ kernel (section 6b)")
else:
    for n in (1024, 4096, 8192):
        q, k, v = (checks.randn(4, 16, n, 64, dtype=torch.float16, seed=i, device="cuda").requires_grad_()
                   for i in range(3))
        naive_peak = memory.peak_memory_bytes(attention.attention_naive, q, k, v)
        flash_peak = memory.peak_memory_bytes(lambda *t: flash(*t, kernels=_all), q, k, v)
        print(f"N={n}: peak {naive_peak / 2**30:.2f} GiB naive, {flash_peak / 2**30:.2f} GiB flash")

# %% nbgrader={"grade_id": "attention_memory", "grade": true, "points": 2}
import torch

from fastdl_lab import attention, checks, device, memory

_dev = "cuda" if device.has_gpu() else "cpu"


def _flash_saved(shape, dtype, causal):
    q, k, v = (checks.randn(shape, dtype=dtype, seed=600 + i, device=_dev).requires_grad_() for i in range(3))
    o = flash(q, k, v, causal=causal, kernels={"fwd": attn_fwd_kernel})
    attention.check_attention(o, q.detach(), k.detach(), v.detach(), causal, name=f"o for {shape}")
    fn = lambda *t: flash(*t, causal=causal, kernels={"fwd": attn_fwd_kernel})  # noqa: E731
    return memory.saved_tensor_bytes(fn, q, k, v)


def _memory_case(b, h, n, d, dtype=torch.float32, causal=False):
    small = _flash_saved((b, h, n, d), dtype, causal)
    large = _flash_saved((b, h, 2 * n, d), dtype, causal)
    scores_bytes = b * h * (2 * n) ** 2 * dtype.itemsize
    assert large < scores_bytes, (
        f"{large} bytes saved for N={2 * n}: at least one N x N matrix ({scores_bytes} bytes) is kept")
    assert large <= 2 * small + 64, f"doubling N took the saved bytes from {small} to {large}: not linear"
    return small, large


_small, _large = _memory_case(1, 2, 128, 32)
print(f"attention_memory: visible test passed ({_small} bytes saved at N=128, {_large} at N=256)")
### BEGIN HIDDEN TESTS
for _args, _kw in [((1, 1, 256, 32, torch.float16), {"causal": True}), ((1, 2, 160, 32), {"causal": True})]:
    _memory_case(*_args, **_kw)
### END HIDDEN TESTS

# %% [markdown]
# ## 8. What your kernels compile to
#
# As in lab 01, Triton compiles your kernels to PTX for a real GPU without one. The score and
# gradient tiles are matrix products, so they should reach the tensor cores: `mma.sync` on an
# A100 (sm_80), `wgmma` (warpgroup MMA) on an H100 (sm_90). The preprocess kernel is a row
# reduction and has none.

# %%
for which, kernel in _all.items():
    if QUICK:  # a compile per kernel, seconds each, that the grade does not need
        print("the kernels' sm_90 PTX is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
        break
    if not attention.kernel_written(kernel):
        print(f"{which:>15} sm_90: not written (optional)")
        continue
    summary = triton_aot.ptx_summary(attention.ptx(90, torch.float16, which=which, kernel=kernel))
    print(f"{which:>15} sm_90: {summary['lines']:5} lines, {summary['wgmma']:3} wgmma, "
          f"{summary['global_loads']:3} global loads")

# %% [markdown]
# ### Masks only where they are needed
#
# A mask is not free. For each score a thread holds, it costs a compare (`ISETP`) and a select
# (`FSEL`) in the loop body, on every key block, while the tensor cores wait for the exponentials.
# Yet in causal attention only the key blocks that straddle the diagonal hold a key later than
# some query: every block before the block's first query is seen whole by every row, and lies
# inside the sequence. The package's kernels (`fastdl_lab/attention/forward.py`, `backward.py`)
# therefore run the loop in two parts: the off-diagonal blocks with no mask at all, then the
# diagonal block(s) with the causal compare. The dK/dV kernel splits its query loop the same way.
# Bounds masks (rows or keys past `N`) are a compile-time choice, `EVEN_N`: the launcher passes
# `True` when `N` is a multiple of both tiles, and the compiler then drops them from every load
# and store. Your kernels, without `EVEN_N` in their signature, are launched without it.
#
# What the split buys, read from the compiled code (no GPU needed: ptxas's resource report and the
# SASS disassembled with the `nvdisasm` Triton ships; fp16, causal, head dim 64, the launch
# configuration, `N` a multiple of the tiles; "loop" counts the instructions of one trip,
# "cmp/sel" the compares and selects among them):
#
# | kernel, GPU | before: loop (cmp/sel), registers | after: off-diagonal loop, diagonal loop, registers |
# |---|---|---|
# | forward, sm_90 (128 × 64 tiles) | 882 (284), 248 | 559 (0), 786 (190), 226 |
# | forward, sm_80 | 1030 (280), 255 | 668 (0), 898 (190), 246 |
# | dK/dV, sm_90 (64 × 64) | 461 (118), 186 | 299 (2), 444 (98), 205 |
# | dK/dV, sm_80 | 599 (118), 255 | 440 (0), 591 (94), 250 |
# | dQ, sm_90 (64 × 64) | 455 (152), 128 | 236 (4), one block unrolled, 128 |
# | dQ, sm_80 | 569 (160), 196 | 335 (0), one block unrolled, 188 |
#
# None spills. For the graded shape ($N = 2048$, 128-query blocks) the forward takes 272 key-block
# steps per slice, 240 of them off the diagonal: 159 thousand issued loop instructions instead of
# 240 thousand, 1.5 times fewer, and 1.6 times fewer in each off-diagonal step. On sm_90 the
# forward also takes a third pipeline stage (a third k, v buffer in flight, 65 KiB of shared
# memory of the 227 KiB an H100 block may use), still at 0 spills: `attention.default_config`
# picks the stages per GPU, and `attention.compiled(capability, ...)` builds a kernel at exactly
# the configuration the launcher uses there. How much faster this runs takes a GPU to say.
#
# The table compares the split at four warps, like with like. The forward now launches with eight:
# at four, its causal build for a ragged length needs all 255 registers and spills 48 bytes on
# sm_80; at eight the 128 query rows are shared by two warpgroups and it takes 116 to 167
# registers, with each warp's loop trip about half as long (313 and 434 instructions on sm_90).
# `benchmarks/results/kernels_sm80.csv` and `kernels_sm90.csv` list every kernel as it launches.

# %% [markdown]
# ## 9. Speed
#
# On a GPU, attention is judged in TFLOP/s: `attention.attention_flops` counts the useful matrix
# products ($4N^2d$ per head forward, $2.5\times$ that backward; causal attention half), and the
# achieved rate is that over the measured time. `F.scaled_dot_product_attention` dispatches to
# FlashAttention-2 (or cuDNN) kernels written in CUDA and tuned for each GPU generation; how
# close a plain Triton kernel with one fixed tile size gets is what the plot shows. The graded
# item races your forward kernel against it on fp16, causal, `(4, 16, 2048, 64)`, interleaved,
# on a GPU grading profile.

# %%
if GPU:
    kernels = {"fwd": attn_fwd_kernel}
    lengths, rates = [512, 1024, 2048, 4096, 8192], {"yours": [], "naive": [], "sdpa": []}
    for n in lengths:
        q, k, v = (checks.randn(16384 // n, 16, n, 64, dtype=torch.float16, seed=i, device="cuda") for i in range(3))
        flops = attention.attention_flops(n, 64, batch_heads=(16384 // n) * 16, causal=True)
        candidates = {"yours": lambda: flash(q, k, v, causal=True, kernels=kernels),
                      "naive": lambda: attention.attention_naive(q, k, v, causal=True),
                      "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
        for label, fn in candidates.items():
            rates[label].append(flops / timing.bench(fn).median / 1e12)
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for (label, values), marker in zip(rates.items(), "os^"):
        ax.plot(lengths, values, marker + "-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N (16k tokens a batch, 16 heads, d = 64, fp16, causal)")
    ax.set_ylabel("TFLOP/s, forward")
    ax.legend(fontsize=8)
    plt.show()
else:
    print("needs a GPU: the interpreter's speed says nothing about the kernel's")

# %% nbgrader={"grade_id": "attention_speed", "grade": true, "points": 2}
import torch
import torch.nn.functional as F

from fastdl_lab import attention, checks, device, timing

if device.has_gpu():
    _q, _k, _v = (checks.randn(4, 16, 2048, 64, dtype=torch.float16, seed=700 + i, device="cuda") for i in range(3))
    _cmp = timing.compare(
        lambda: flash(_q, _k, _v, causal=True, kernels={"fwd": attn_fwd_kernel}),
        lambda: F.scaled_dot_product_attention(_q, _k, _v, is_causal=True))
    _tflops = attention.attention_flops(2048, 64, batch_heads=64, causal=True) / _cmp.candidate.median / 1e12
    print(f"your forward vs F.scaled_dot_product_attention: {_cmp.speedup:.2f}x "
          f"(95% CI {_cmp.ci_low:.2f}-{_cmp.ci_high:.2f}), {_tflops:.0f} TFLOP/s")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## Summary
#
# - Naive attention writes and reads the $N\times N$ scores and probabilities: $4N^2$ elements of
#   traffic for $4N^2d$ FLOPs, an intensity of $d/2$, far below any GPU's ridge. It is memory-bound,
#   and autograd keeps $P$: memory quadratic in the sequence length.
# - The online softmax keeps a running maximum, a running sum and an unnormalised output, and
#   rescales them by $e^{m - m'}$ whenever the maximum grows: the row is normalised once, at the
#   end, and never has to exist in full.
# - An `autograd.Function` decides what autograd keeps: saving $O$ and one logsumexp per row, and
#   walking the key blocks again in the backward, makes the whole algorithm linear in memory in
#   plain PyTorch, before any kernel is written.
# - The forward kernel keeps a query block's state in registers and streams the keys: $Q, K, V$ in,
#   $O$ and one logsumexp per row out.
# - The backward rebuilds every probability tile from $Q$, $K$ and the logsumexp, uses
#   $\delta = \operatorname{rowsum}(dO \circ O)$ for the softmax Jacobian, and splits the work
#   into a key-block kernel and a query-block kernel so that no address has two writers.
# - Masks cost a compare and a select per score: a good kernel runs the blocks off the causal
#   diagonal unmasked and compiles bounds masks in only for lengths that are not a multiple of
#   the tiles.
# - Recomputation trades a few extra FLOPs for $N^2$ bytes: on hardware whose arithmetic outruns
#   its memory, that is the right trade.
