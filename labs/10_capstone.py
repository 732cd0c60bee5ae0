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
# # Lab 10 — The capstone: a real training step, end to end
#
# Every lab so far took one technique on its own. This one puts them into one model, a small GPT,
# and asks the question a systems engineer asks of any training job: **where do the time and the
# memory of a step go?** The model's LayerNorm, attention and optimizer can each be torch's or the
# course's (labs 03, 05 and 04); its data are lab 06's corpus read as bytes. In this lab you will:
#
# 1. meet the model and choose its parts *(section 1, about 20 minutes)*;
# 2. write its transformer block, the one piece of the model the package leaves to you, and train
#    a model made of it *(section 2, about 75 minutes; graded: `capstone_block` 3 points,
#    `capstone_training` 2 points)*;
# 3. time a step: tokens per second, the model FLOPs utilisation (MFU), and the share of FLOPs
#    against the share of time, op class by op class *(section 3, about 45 minutes)*;
# 4. account for a step's memory, weights, gradients, optimizer state and activations, with a
#    formula you derive and the grader checks against its own measurement on sizes you do not see
#    *(section 4, about 60 minutes; graded: `capstone_memory`, 3 points)*;
# 5. run three experiments with plots: activation checkpointing per block, bf16 autocast against
#    fp32, and `torch.compile` of the model with its graph breaks *(section 5, about 45 minutes)*;
# 6. on a GPU, race a step of a model of your blocks against the package's block, and the course's
#    kernels against torch's *(section 6, about 25 minutes; graded on GPU profiles:
#    `capstone_step_speed`, 2 points)*.
#
# **How this lab is graded.** The grader takes your class `Block` and your function
# `predict_memory` out of their cells and runs each on its own, in a sandbox, on hidden sizes. Both
# see only `math`, `torch`, `F`, `nn`, and the package's `GPTConfig` and `LayerNorm`: no imports
# inside them. Every figure your grade rests on is the grader's: it compares your block's outputs
# and gradients with its own, computes the held-out loss of the weights your training returns, and
# measures the memory your formula predicts.
#
# **Time:** about 4.5 hours for a student who has done the labs before it, by section in minutes:
# §1 20; §2 75; §3 45; §4 60; §5 45; §6 25. The estimates are the course's, not measured on a
# class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import math  # noqa: F401  (one of the grader's names, for your cells)

import torch
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks
from fastdl_lab.capstone import accounting, bench, breakdown, data, experiments, step
from fastdl_lab.capstone import model as gpt_model
from fastdl_lab.capstone.model import GPTConfig, LayerNorm

DEV = "cuda" if device.has_gpu() else "cpu"
QUICK = device.quick()  # the grader's run of the notebook: ungraded experiments at tiny sizes

# %% [markdown]
# ## 1. The model and its parts
#
# GPT-2's layout at any size: a token embedding and a position embedding, `n_layer` pre-norm
# blocks, a last LayerNorm, and an output projection that *is* the token embedding's matrix (tied:
# one matrix, two uses). A block is
#
# $$x \leftarrow x + \mathrm{Attn}(\mathrm{LN}_1(x)), \qquad x \leftarrow x + \mathrm{MLP}(\mathrm{LN}_2(x)),$$
#
# with causal self-attention over `n_head` heads and an MLP of width `4 d` with GELU. The
# vocabulary is 256: the model reads bytes, so there is no tokenizer to install or explain.
#
# Two sizes come with the package. `CPU_CONFIG` trains on a laptop in minutes. `GPU_CONFIG` is GPT-2
# medium's shape (24 blocks of width 1024, 1024 tokens), with the vocabulary padded from 50257 to
# 50304, a multiple of 64, for the tensor cores' sake (lab 01).

# %%
for name, config in (("CPU_CONFIG", gpt_model.CPU_CONFIG), ("GPU_CONFIG", gpt_model.GPU_CONFIG)):
    print(f"{name}: {config}\n  {gpt_model.param_count(config):,} parameters, "
          f"{gpt_model.matmul_flops_per_token(config)['total'] / 1e6:.1f} MFLOP per token forward")

# %% [markdown]
# **The parts.** `LayerNorm` and attention are arguments of the model: a function
# `layernorm(x, weight, bias, eps)` and a function `attention(q, k, v)` on `(batch, heads, tokens,
# head_dim)` tensors, causal. The package names the ones it has:
#
# | name | LayerNorm | attention |
# |---|---|---|
# | `"torch"` | `F.layer_norm` | `F.scaled_dot_product_attention(is_causal=True)` |
# | `"math"` | | scores, mask, softmax, weighted sum, written out |
# | `"course-pytorch"` | lab 03's algorithm in PyTorch | lab 05's FlashAttention as an `autograd.Function` in PyTorch |
# | `"course-triton"` | lab 03's Triton kernels | lab 05's Triton kernels |
#
# The `course-*` parts are the package's reference versions of what you wrote in labs 03 and 05.
# Your copy of the package leaves out what a lab grades (lab 05's attention, in PyTorch and in
# Triton): where a part is left out, the cell below says so and uses torch's. To train on *your own*
# kernels, paste your lab 03 `layer_norm` or your lab 05 attention into the cell below and pass the
# function instead of a name. On a CPU the Triton parts run in the
# interpreter, seconds per call: fine for a check at a small size, not for training, so the CPU
# default here is `course-pytorch`.

# %%
MY_LAYERNORM = None  # your lab 03 function (x, weight, bias, eps) -> y, or None
MY_ATTENTION = None  # your lab 05 function (q, k, v) -> o, causal, or None
course_kernels = "course-triton" if device.has_gpu() else "course-pytorch"
PARTS = {}
for part, mine in (("layernorm", MY_LAYERNORM), ("attention", MY_ATTENTION)):
    PARTS[part], what = gpt_model.usable_part(part, mine or course_kernels)
    print(f"{part}: {what}")

# %% [markdown]
# ## 2. The block
#
# The package builds everything around the block: embeddings, the last LayerNorm, the tied
# projection, the loss, checkpointing and autocast. The block itself is yours. Its constructor is
# given, so that its parameters have the names, shapes and order of the package's (`ln1`,
# `attn.qkv`, `attn.proj`, `ln2`, `mlp.fc`, `mlp.proj`): a model built with the same seed then has
# the same weights whichever block it uses, and any difference in what it computes is the block's.
#
# Write `forward(x)` for `x` of shape `(batch, tokens, d_model)`:
#
# 1. `h = self.ln1(x)`; `self.attn["qkv"](h)` gives `(batch, tokens, 3 d)`: queries, keys and
#    values side by side, each `n_head` heads of `d / n_head`. Split them into three tensors of shape
#    `(batch, n_head, tokens, head_dim)`, the layout every attention of the course takes;
# 2. `o = self.attention(q, k, v)` (the function the block was given: it applies the causal mask);
# 3. put the heads back side by side, `(batch, tokens, d)`, project with `self.attn["proj"]`, and
#    add to `x`;
# 4. `x + self.mlp["proj"](gelu(self.mlp["fc"](self.ln2(x))))`, GELU with `approximate="tanh"`
#    (GPT-2's).
#
# Mind the split. `view(batch, tokens, 3, n_head, head_dim)` then a permutation keeps each token's
# numbers with that token; a `view` straight to `(batch, n_head, tokens, head_dim)` reinterprets the
# memory and mixes tokens across heads, and the model then sees the future.

# %% nbgrader={"grade_id": "block_code", "solution": true}
class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config, layernorm, attention):
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.attention = attention
        self.ln1 = LayerNorm(d, layernorm, config.eps)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d)})
        self.ln2 = LayerNorm(d, layernorm, config.eps)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(d, config.mlp_ratio * d), "proj": nn.Linear(config.mlp_ratio * d, d)})

    def forward(self, x):
        ### BEGIN SOLUTION
        b, t, d = x.shape
        qkv = self.attn["qkv"](self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        o = self.attention(q, k, v)
        x = x + self.attn["proj"](o.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.ln2(x)), approximate="tanh"))
        ### END SOLUTION


# %% [markdown]
# Your block against the package's, with the same weights, forward and backward; then the test
# that names the commonest mistake: does position 3's output change when a *later* token does?

# %%
def compare_blocks(config, batch=2, seed=0):
    """Max |difference| of the output and of dx between your block and the package's."""
    parts = (gpt_model.LAYER_NORMS["torch"], gpt_model.ATTENTIONS["torch"])
    mine, ref = Block(config, *parts), gpt_model.Block(config, *parts)
    mine.load_state_dict(ref.state_dict())
    x = checks.randn(batch, config.seq_len, config.d_model, seed=seed)
    outs = []
    for block in (mine, ref):
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.sum().backward()
        outs.append((y.detach(), xi.grad))
    return {"y": (outs[0][0] - outs[1][0]).abs().max().item(), "dx": (outs[0][1] - outs[1][1]).abs().max().item()}


def sees_the_future(config, position=3):
    block = Block(config, gpt_model.LAYER_NORMS["torch"], gpt_model.ATTENTIONS["torch"])
    x = checks.randn(1, config.seq_len, config.d_model, seed=1)
    later = x.clone()
    # Other tokens, not the same ones shifted: LayerNorm takes each token's mean away, so adding a
    # constant to later tokens changes almost nothing a block could see.
    later[0, position + 1:] = checks.randn(config.seq_len - position - 1, config.d_model, seed=2)
    with torch.no_grad():
        return not torch.allclose(block(x)[0, :position + 1], block(later)[0, :position + 1])


small = GPTConfig(seq_len=24, d_model=48, n_head=3, n_layer=1)
print("your block against the package's:", compare_blocks(small))
print("a position sees later tokens:", sees_the_future(small))

# %% nbgrader={"grade_id": "capstone_block", "grade": true, "points": 3}
_diff = compare_blocks(GPTConfig(seq_len=19, d_model=32, n_head=2, n_layer=1), batch=3)
assert _diff["y"] < 1e-4 and _diff["dx"] < 1e-4, _diff
assert not sees_the_future(GPTConfig(seq_len=16, d_model=32, n_head=4, n_layer=1)), "the block is not causal"
print("capstone_block: visible tests passed")

# %% [markdown]
# **Train it.** A model of your blocks, with the parts you chose, on the byte stream: AdamW
# (torch's, lab 04's contract), learning rate 1e-3, batch 8. The loss starts near
# $\ln 256 \approx 5.55$ (a uniform guess over bytes) and falls as the model learns which bytes
# follow which. The losses stay on the device until the end of the run: a `.item()` per step would
# wait for the device every step (lab 06).

# %%
# The grader's quick run trains a smaller model for fewer steps: the grade needs none of this cell.
config = GPTConfig(seq_len=64, d_model=64, n_head=4, n_layer=2) if QUICK else gpt_model.CPU_CONFIG
steps = 10 if QUICK else 300
gpt = gpt_model.build(config, block=Block, device=DEV, **PARTS)
optimizer = step.make_optimizer(gpt)
losses = step.train(gpt, optimizer, steps, batch_size=8, log=print, log_every=100)
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {steps} steps; validation loss "
      f"{step.validation_loss(gpt, batch_size=8):.3f}")

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5, 3))
ax.plot(range(1, len(losses) + 1), losses)
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title("a GPT of your blocks on the standard library's docstrings")
fig.tight_layout()

# %% nbgrader={"grade_id": "capstone_training", "grade": true, "points": 2}
_ref = gpt_model.build(GPTConfig(seq_len=32, d_model=32, n_head=2, n_layer=2))
_mine = gpt_model.build(GPTConfig(seq_len=32, d_model=32, n_head=2, n_layer=2), block=Block)
_l_ref = step.train(_ref, step.make_optimizer(_ref), 5, batch_size=4)
_l_mine = step.train(_mine, step.make_optimizer(_mine), 5, batch_size=4)
assert abs(_l_mine[-1] - _l_ref[-1]) < 1e-3, (_l_mine, _l_ref)
print("capstone_training: visible tests passed")

# %% [markdown]
# ## 3. Where a step's time goes
#
# A step is `zero_grad`, a forward, a backward and the optimizer's step. `step.step_throughput`
# times the whole of it with the course's harness (warm-up, then the median of repetitions; on a GPU
# each repetition synchronises) and gives **tokens per second** and the **MFU**: the matmul FLOPs a
# step must do (`3 ×` the forward's: the backward computes two products for each of the forward's),
# divided by the time, divided by the machine's peak.
#
# The peak here is measured, as in lab 00: the FLOP rate of a large matmul on this machine, fp32 on
# a CPU, bf16 on a GPU. An MFU against a measured matmul peak says what fraction of the machine's
# *achievable* matmul rate the model gets; against a datasheet peak it would be lower.

# %%
# The capstone benchmark's measurement (fastdl_lab/capstone/bench.py), at this notebook's sizes.
peak = bench.measured_peak(8192 if DEV == "cuda" else 512 if QUICK else 1024, DEV, reps=3 if QUICK else 10)
gpt = gpt_model.build(config, block=Block, device=DEV, **PARTS)
optimizer = step.make_optimizer(gpt)
t = step.step_throughput(gpt, optimizer, batch_size=8, reps=3 if QUICK else 10, peak_flops=peak)
print(f"peak {peak / 1e9:.1f} GFLOP/s; a step {t['seconds'] * 1e3:.1f} ms, {t['tokens_per_s']:,.0f} tokens/s, "
      f"MFU {t['mfu']:.1%}")

# %% [markdown]
# **FLOPs against time.** In BERT the matrix multiplies are 99.8% of the FLOPs but about 61% of
# the time (Ivanov et al., *Data Movement Is All You Need*, MLSys 2021); the rest goes to ops that
# move memory and do almost no arithmetic. `breakdown.flop_time_table` measures the same split for
# any step: FLOPs per op from `FlopCounterMode`, each op's own time from `torch.profiler`, grouped by
# op class. The attention is the `"math"` one here, so that its two matmuls are ops a profiler can
# see (torch's fused kernel is one opaque op to both counters). Lab 02 ran it on the package's
# block; this is yours.

# %%
if QUICK:  # the profiler's start-up alone is seconds per graded run, and the grade needs none of it
    print("the FLOPs-against-time table is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    profiled = gpt_model.build(config, block=Block, attention="math", device=DEV)
    x, y = next(data.batches("train", 1, 8, config.seq_len, device=DEV))
    shares = breakdown.flop_time_table(breakdown.training_step(profiled, x, y), steps=5)
    for r in shares:
        print(f"{r['class']:>12}: {r['flops_share']:6.1%} of the FLOPs, {r['time_share']:6.1%} of the time")
    breakdown.plot_shares(shares, title=f"your GPT, d={config.d_model}, {config.n_layer} blocks, batch 8, on {DEV}");

# %% [markdown]
# On the 2-core course machine the matmuls did all the counted FLOPs in about half the time
# (`benchmarks/results/experiments.csv`, the row of lab 02's run of this model). There, a step of
# `CPU_CONFIG` at batch 8 took 66 ms on torch's parts, 15 400 tokens/s and an MFU of 40% against a
# measured fp32 matmul peak of 221 GFLOP/s, and 110 ms on the course's plain-PyTorch parts (MFU 24%:
# lab 05's FlashAttention in PyTorch loops over blocks that torch's kernel does in one call;
# `benchmarks/results/capstone.csv`). The non-matmul half is the fusion opportunity: every
# elementwise op, softmax and LayerNorm reads and writes the whole activation for almost no
# arithmetic. Which of labs 02, 03 and 05 removes which slice?

# %% [markdown]
# ## 4. Where a step's memory goes
#
# When the forward ends, a step holds four things:
#
# - the **weights**, 4 bytes per parameter in fp32;
# - the **gradients**, as many again (the backward writes them; the optimizer reads them);
# - **AdamW's state**, two moments per parameter: 8 bytes (lab 04's bytes per parameter);
# - the **activations**: every tensor the forward saved for the backward. These grow with the batch
#   and the sequence, and for a large batch they are the largest part.
#
# `accounting.measure` counts the four on the package's model after an AdamW step: the first three
# by storage, the activations with `torch.autograd.graph.saved_tensors_hooks` (each storage once:
# an op that saves a view of a tensor another op saved costs nothing more). On a GPU,
# `torch.cuda.memory._record_memory_history()` and a snapshot show the same tensors as blocks of the
# allocator, in time.

# %%
probe = GPTConfig(seq_len=64, d_model=64, n_head=4, n_layer=2)
measured = accounting.measure(probe, batch_size=4)
for part, n in measured.items():
    print(f"{part:>12}: {n:>10,} bytes")

# %% [markdown]
# **Your formula.** Write `predict_memory(config, batch_size, attention, recompute_blocks)`
# returning a dict of bytes with the keys `weights`, `grads`, `optimizer` and `activations`, for
# the fp32 model with AdamW, where `attention` is `"torch"` (the fused kernel) or `"math"` (the
# definition written out) and the first `recompute_blocks` blocks are checkpointed.
#
# Derive the activations op by op. Walk one block's forward and ask, for each op, what its backward
# needs: a `Linear` needs its input; GELU needs its input; LayerNorm needs its input and a mean and
# a reciprocal standard deviation per row; the fused attention keeps `q`, `k`, `v`, its output and
# one log-sum-exp per row and head; the written-out attention keeps the softmax's output, a
# `(tokens, tokens)` matrix per head, and the mask. Count each *storage* once: `q`, `k` and `v` are
# views of one tensor, and a tensor two ops save is one tensor. Then the rest of the model: the
# token ids, the positions, the last LayerNorm, the loss (`cross_entropy` saves the log-softmax of
# the logits, `batch × tokens × vocab` floats). A checkpointed block keeps only its input.
#
# `accounting.measure` is your check: vary one size at a time and see which terms move. The grader
# judges your function on configurations you do not see, against its own measurement: weights,
# gradients and optimizer state to 0.1%, activations to 3%.

# %% nbgrader={"grade_id": "memory_code", "solution": true}
def predict_memory(config, batch_size, attention="torch", recompute_blocks=0):
    ### BEGIN SOLUTION
    V, T, d, H, L = config.vocab_size, config.seq_len, config.d_model, config.n_head, config.n_layer
    n = batch_size * T
    weights = 4 * ((V + T) * d + L * ((4 + 2 * config.mlp_ratio) * d * d + (9 + config.mlp_ratio) * d) + 2 * d)
    block = 4 * (16 * n * d + 4 * n)
    if attention == "torch":
        block += 4 * batch_size * H * T
    else:
        block += 4 * batch_size * H * T * T + T * T
    kept = min(recompute_blocks, L)
    rest = 8 * n + 8 * T + 4 * (2 * n * d + 2 * n) + 4 * n * V + 8 * n + 4
    activations = (L - kept) * block + kept * 4 * n * d + rest
    return {"weights": weights, "grads": weights, "optimizer": 2 * weights, "activations": activations}
    ### END SOLUTION


# %%
predicted = predict_memory(probe, 4)
for part in accounting.PARTS:
    print(f"{part:>12}: predicted {predicted[part]:>10,}, measured {measured[part]:>10,}")
accounting.plot_split(measured, predicted, title=f"d={probe.d_model}, {probe.n_layer} blocks, "
                                                 f"{probe.seq_len} tokens, batch 4");

# %% nbgrader={"grade_id": "capstone_memory", "grade": true, "points": 3}
for _cfg, _b, _attn, _k in ((GPTConfig(seq_len=32, d_model=32, n_head=2, n_layer=2), 2, "torch", 0),
                            (GPTConfig(seq_len=40, d_model=48, n_head=4, n_layer=1, vocab_size=300), 3, "math", 0),
                            (GPTConfig(seq_len=32, d_model=32, n_head=2, n_layer=3), 2, "torch", 2)):
    _m = accounting.measure(_cfg, _b, attention=_attn, recompute_blocks=_k)
    _errors = accounting.relative_errors(predict_memory(_cfg, _b, _attn, _k), _m)
    assert max(_errors[p] for p in ("weights", "grads", "optimizer")) < 1e-3, (_cfg, _errors)
    assert _errors["activations"] < 0.03, (_cfg, _attn, _k, _errors)
print("capstone_memory: visible tests passed")

# %% [markdown]
# Now the sizes that matter. For `GPU_CONFIG` at batch 8 your formula says how the memory of a step
# divides; the written-out attention's `T × T` matrices alone are `4 · 8 · 16 · 1024² = 512 MiB` per
# block. Which part would ZeRO (lab 07) shard, and which would checkpointing (section 5) cut?

# %%
for attention in ("torch", "math"):
    big = predict_memory(gpt_model.GPU_CONFIG, 8, attention)
    print(f"GPU_CONFIG, batch 8, {attention} attention: "
          + ", ".join(f"{part} {n / 2**30:.1f} GiB" for part, n in big.items()))

# %% [markdown]
# ## 5. Three experiments
#
# **Activation checkpointing.** A checkpointed block keeps only its input and runs its forward
# again during the backward: memory bought with time (lab 02's recompute-instead-of-save, per
# block). `experiments.checkpointing_sweep` checkpoints the first 0, 1, ..., `n_layer` blocks.
#
# **bf16 autocast against fp32.** The same weights on the same batches, the matmuls in bf16, the
# weights, optimizer and loss in fp32 (lab 04). Autocast is entered per forward: its cache of bf16
# weight copies lives as long as its context, so a context held across steps feeds every step the
# first step's weights (the package's model measured it: a loss of 5.22 after 20 steps where fp32
# reached 3.38).
#
# **`torch.compile`.** The first step compiles; the later ones run the fused kernels. Dynamo's
# `explain` names every graph break.

# %%
exp_config = GPTConfig(seq_len=32, d_model=32, n_head=2, n_layer=2) if QUICK else config
if QUICK:
    print("the experiments' time is left out of the grader's quick run: checkpointing on a tiny model only")
sweep = experiments.checkpointing_sweep(exp_config, batch_size=8, reps=2 if QUICK else 5)
for r in sweep:
    print(f"{r['recompute_blocks']} blocks recomputed: {r['activation_bytes'] / 2**20:6.2f} MiB saved, "
          f"{r['seconds'] * 1e3:6.1f} ms per step")
experiments.plot_checkpointing(sweep);

# %%
if not QUICK:
    runs = experiments.precision_runs(config, batch_size=8, steps=100)
    experiments.plot_precision(runs);

# %%
if not QUICK:
    compiled = experiments.compile_runs(config, batch_size=8, steps=6)
    for name, r in compiled.items():
        print(name, {k: v for k, v in r.items()})

# %% [markdown]
# On the 2-core course machine (`benchmarks/results/capstone.csv`, `CPU_CONFIG` at batch 8, one run
# on 2026-11-29): checkpointing all four blocks cut the saved activations from 35.8 MB to 4.2 MB,
# and the step times of the five settings (70 to 86 ms) came in no clear order (the sweep's
# timings are not interleaved; the lab's own cell, run again on that machine, went from 71 ms with
# no block recomputed to 104 ms with all four, about a third more: one extra forward); bf16
# autocast saved 37% of the activations (22.5 MB) and was *slower*, 105 ms against 79 ms per step,
# on a CPU without AVX512-BF16, while its loss after 100 steps (3.05) tracked fp32's (3.17); the
# compiled model's first step took 28.6 s with an empty compile cache (4.9 s with a warm one),
# one graph and no break, and its later steps 67 ms against eager's 68. On a GPU each answer is different: run this section there.

# %% [markdown]
# ## 6. On a GPU: your block's step against the package's
#
# On a GPU the block's own work counts: a `.contiguous()` too many, the attention written out
# instead of the function given, a head split that copies, each is a pass over the activations in
# every block of every step. The graded race: a bf16 training step of a model of GPT-2 small's width
# (d = 768, 12 heads, 4 blocks, 1024 tokens) made of your blocks, against the same model made of the
# package's, both on torch's LayerNorm and attention, timed call by call on the grader's clock. It
# passes when your step is at most about 11% slower (a speed-up of 0.9). The cell below also races
# the course's kernels (`course-triton`: labs 03 and 05) against torch's, where your copy of the
# package has them. Without a GPU nothing is graded and the cell says so.

# %% nbgrader={"grade_id": "capstone_step_speed", "grade": true, "points": 2}
if device.has_gpu():
    _cfg = GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_head=12, n_layer=4)
    _times = {}
    for _name, _block, _parts in (("your blocks, torch's kernels", Block, "torch"),
                                  ("the package's blocks, torch's kernels", None, "torch"),
                                  ("your blocks, the course's kernels", Block, "course-triton")):
        _ln, _ = gpt_model.usable_part("layernorm", _parts)
        _attn, _what = gpt_model.usable_part("attention", _parts)
        _gpt = gpt_model.build(_cfg, layernorm=_ln, attention=_attn, device="cuda", block=_block)
        _gpt.autocast_dtype = torch.bfloat16
        _times[f"{_name} (attention: {_what})"] = step.step_throughput(_gpt, step.make_optimizer(_gpt),
                                                                      batch_size=8)["seconds"]
    for _name, _s in _times.items():
        print(f"{_s * 1e3:8.1f} ms  {_name}")
else:
    print("needs a GPU: the interpreter's speed says nothing about the kernels'")
