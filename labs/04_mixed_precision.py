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
# # Lab 04 — Mixed precision and fused optimizers
#
# Half the bits per number means half the bytes to move, twice the values per register and, on
# tensor cores, several times the FLOP/s. Mixed-precision training takes that gain without losing
# the model: the arithmetic that tolerates rounding runs in 16 bits, the arithmetic that does not
# stays in 32. In this lab you will:
#
# 1. meet fp32, tf32, fp16, bf16 and fp8 by experiment: where each overflows, underflows and
#    rounds a training update away *(section 1, about 30 minutes)*;
# 2. run a training step under `torch.autocast` and see which operations change precision
#    *(section 2, about 20 minutes)*;
# 3. watch a model stop learning in fp16 because its gradients flush to zero, and rescue it with a
#    **dynamic loss scaler** you write by hand *(section 3, about 60 minutes; graded:
#    `loss_scaler`, 3 points)*, inside a complete **AMP training step** *(section 4, about
#    30 minutes; graded: `amp_train_step`, 2 points)*;
# 4. count the **bytes per parameter** of a training run under different recipes *(section 5,
#    about 40 minutes; graded: `bytes_per_param`, 2 points)*;
# 5. write AdamW as **one Triton kernel for a whole list of tensors** *(section 6, about
#    90 minutes for this item; graded: `fused_adamw`, 4 points)* and an optimizer that launches it
#    once per step *(graded: `fused_adamw_launches`, 2 points)*; on a GPU, race PyTorch's
#    multi-tensor AdamW *(graded on GPU profiles: `fused_adamw_speed`, 2 points)*.
#
# **How this lab is graded.** The grader does not run your notebook as a whole. It takes out of
# your solution cells only the classes, functions, `@triton.jit` kernels and literal constants
# (`BLOCK = 1024`), and runs each on its own with these names available: `math`, `torch`, `nn`,
# `F`, `triton`, `tl` and `multi_tensor_table`. Anything else a cell does at its top level
# (imports included) does not reach the grader. Graded classes and functions may not import, use
# `getattr`/`eval`, touch `_private` attributes of other objects, or call PyTorch's own loss scaler
# or Adam: the point is to write them.
#
# **Time:** about 4.5 hours for a student who has done the labs before it, by section in minutes:
# §1 30; §2 20; §3 60; §4 30; §5 40; §6 90. Graded code regions take most of it; the estimates are
# the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import math

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from torch import nn

from fastdl_lab import amp, checks, memory, optim, timing, triton_aot

GPU = device.has_gpu()
DEV = "cuda" if GPU else "cpu"
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. Number formats, by experiment
#
# A floating-point number is $(-1)^s \cdot 1.m \cdot 2^{e - \text{bias}}$. The **exponent bits**
# decide the range (largest and smallest normal number); the **mantissa bits** decide the
# precision (the gap between 1 and the next number, *machine epsilon*). Below the smallest normal
# number, *subnormals* trade precision for a little more range, down to one last step before zero.
# `amp.FORMATS` derives every figure from `torch.finfo` (tf32 is fp32 storage with a 10-bit
# mantissa inside tensor-core matmuls):

# %%
import pandas as pd

columns = ("bits", "exponent_bits", "mantissa_bits", "max", "smallest_normal", "smallest_subnormal", "eps")
pd.DataFrame({name: {c: getattr(f, c) for c in columns} for name, f in amp.FORMATS.items()}).T

# %% [markdown]
# Three formats of 16 bits or fewer, three different trade-offs. fp16 has 10 mantissa bits but only
# 5 exponent bits: it overflows at 65504. bf16 keeps fp32's 8 exponent bits (same range, to
# $3.4\cdot10^{38}$) and keeps only 7 mantissa bits: about two and a half decimal digits. fp8
# comes in two flavours for the two directions of training: e4m3 (more precision, max 448) for
# weights and activations, e5m2 (more range) for gradients.
#
# ### Range: overflow and underflow

# %%
acts = torch.tensor([10.0, 200.0, 300.0, 70000.0])
print("activations          ", acts.tolist())
print("squared in fp16      ", (acts.half() * acts.half()).tolist())
print("squared in bf16      ", (acts.bfloat16() * acts.bfloat16()).tolist())
grads = torch.tensor([1e-3, 1e-5, 1e-7, 1e-8, 1e-9])
print("gradients            ", grads.tolist())
for name in ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3"):
    print(f"through {name:<13}", amp.round_to(grads, name).tolist())

# %% [markdown]
# A product of two ordinary activations already overflows fp16, and a gradient of $10^{-8}$ is
# zero in it. bf16 shrugs at both: its range is fp32's. That single fact is why bf16 training
# needs no loss scaling, and fp16 training does.
#
# Gradients are small for a reason: a loss averaged over a batch of $B$ examples scales each
# example's contribution by $1/B$, and back-propagation multiplies by weights and activation
# derivatives that are often well below one. Here is a realistic spread of gradient magnitudes
# (log-normal around $10^{-6}$) and the fraction each format flushes to zero:

# %%
spread = torch.exp(torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 2.5 + math.log(1e-6))
for name in ("fp32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3"):
    lost = (amp.round_to(spread, name) == 0).float().mean().item()
    print(f"{name:<9} flushes {lost:7.2%} of these gradients to zero")

# %% [markdown]
# The same spread as a histogram of $\log_2 |g|$, with each format's smallest subnormal: what lies
# left of a format's line is zero in it (half the subnormal, really: round to nearest). Loss scaling
# multiplies every gradient by $S$ before backward, which shifts the whole histogram right by
# $\log_2 S$ binades; the orange copy is the spread at $S = 2^{16}$. Where 13% of the gradients were
# below fp16's line, none is now, and the largest (about $2^{12.5}$) is still below fp16's largest
# value, 65504 (just under $2^{16}$). Scale much further and the largest gradients overflow instead:
# a dynamic scaler grows $S$ until that happens, then backs off. (bf16's and fp32's smallest
# subnormals are off the plot, far to the left: $2^{-133}$ and $2^{-149}$.)

# %%
fig, ax = plt.subplots(figsize=(7, 3.4))
bins = torch.arange(-45.0, 21.0).tolist()
log2_spread = spread.abs().log2()
ax.hist(log2_spread.tolist(), bins=bins, alpha=0.6, label="gradients")
ax.hist((log2_spread + 16).tolist(), bins=bins, alpha=0.5, label="× $2^{16}$ (loss scaling)")
for name, color in (("fp16", "C3"), ("fp8_e5m2", "C4"), ("fp8_e4m3", "C2")):
    ax.axvline(math.log2(amp.FORMATS[name].smallest_subnormal), color=color, linestyle="--",
               label=f"{name} smallest subnormal")
ax.axvline(math.log2(amp.FORMATS["fp16"].max), color="C3", linestyle=":", label="fp16 largest value")
ax.set_xlabel("$\\log_2 |g|$")
ax.set_ylabel("gradients")
ax.legend(fontsize=7, loc="upper right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ### Precision: an update rounded away, a sum that stops growing
#
# A weight of 1.0 receives the update $-\text{lr}\cdot g = -10^{-4}$. In fp32 it moves. In bf16 the
# gap between 1 and the next number is $2^{-7} \approx 0.0078$, and in fp16 it is
# $2^{-10} \approx 0.00098$: the update is less than half a gap, so the weight does not move at
# all, whatever the number of steps. This is why optimizers keep an **fp32 master copy** of the
# weights even when the model computes in 16 bits.

# %%
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    w = torch.tensor(1.0, dtype=dtype)
    for _ in range(1000):
        w = w - torch.tensor(1e-4, dtype=dtype)
    print(f"{str(dtype):<15} 1.0 after 1000 updates of -1e-4: {w.item():.4f}  (exact: 0.9000)")

# %% [markdown]
# The same effect limits sums. Adding $0.01$ twenty thousand times should give 200; an fp16
# accumulator stops growing as soon as $0.01$ falls below half its gap (at 32), a bf16 one already
# at 4. This is why
# matmul units multiply 16-bit inputs but **accumulate in fp32**, and why reductions (softmax,
# norms, the loss) run in fp32 under autocast.

# %%
def accumulate(value, count, dtype):
    """Add ``value`` ``count`` times to an accumulator that is rounded to ``dtype`` after each addition."""
    step, acc = torch.tensor(value, dtype=dtype), torch.zeros((), dtype=dtype)
    for _ in range(count):
        acc = acc + step
    return acc.item()


for dtype in (torch.bfloat16, torch.float16, torch.float32):
    print(f"{str(dtype):<15} 20,000 x 0.01 accumulated in that dtype: {accumulate(0.01, 20_000, dtype):8.3f}  (exact 200)")

# %% [markdown]
# ## 2. Autocast: 16 bits where it is safe, 32 where it is not
#
# `torch.autocast` changes the dtype per operation, not per model. Matmuls and convolutions run in
# the low-precision type (that is where the tensor cores are); operations that lose accuracy in it
# (`log`, `exp`-heavy reductions, losses) run in fp32; the weights themselves stay fp32 (the
# master copy) and are cast on the fly. The lists are a policy per device: on CUDA, `layer_norm`
# and `softmax` are promoted to fp32 too, while the CPU's bf16 policy leaves them in bf16 (as the
# output below shows on a CPU). The loss is fp32 on both.

# %%
model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)).to(DEV)
x = checks.randn(32, 64, seed=1, device=DEV)
seen = []
hooks = [m.register_forward_hook(lambda m, i, o: seen.append((type(m).__name__, str(o.dtype)[6:])))
         for m in model]
amp_dtype = torch.float16 if GPU else torch.bfloat16
with torch.autocast(device_type=DEV, dtype=amp_dtype):
    logits = model(x)
    loss = F.cross_entropy(logits, torch.zeros(32, dtype=torch.long, device=DEV))
for h in hooks:
    h.remove()
print("layer outputs under autocast:", seen)
print("loss:", loss.dtype, "| weights:", model[0].weight.dtype)

# %% [markdown]
# An fp32 step and an autocast step side by side, from the same start: the curves agree to the
# rounding of 16-bit matmuls. (On a CPU, bf16 gains speed only where the processor has bf16
# instructions, AVX512-BF16 or AMX: without them the matmuls widen bf16 to fp32 and gain nothing.
# `benchmarks/amp.py` measures the throughput on a CPU and on a GPU; the CPU run in
# `benchmarks/results/amp.csv`, on an AMD EPYC, took a bf16 step 2.2× faster than an fp32 one.)

# %%
def curve(step, steps=30):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).to(DEV)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    data = checks.randn(steps, 64, 64, seed=2, device=DEV)
    target = (data.sum(-1) > 0).long() * 3
    return [step(net, opt, xb, yb) for xb, yb in zip(data, target)]


def autocast_step(net, opt, xb, yb):
    # bf16 (the CPU's autocast type) needs no loss scaling; fp16 does, which section 3 is about.
    with torch.autocast(device_type=DEV, dtype=torch.bfloat16):
        loss = F.cross_entropy(net(xb), yb)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


steps = 6 if QUICK else 30
plain = curve(lambda net, opt, xb, yb: amp.train_step_fp32(net, opt, xb, yb, F.cross_entropy), steps)
mixed = curve(autocast_step, steps)
plt.plot(plain, label="fp32")
plt.plot(mixed, label="autocast bf16")
plt.xlabel("step")
plt.ylabel("loss")
plt.legend()
plt.show()

# %% [markdown]
# ## 3. Loss scaling
#
# Now the failure that fp16 training is famous for. `amp.underflow_experiment` trains a small model
# whose gradients are small, as a deep network's are, once in fp32 and twice with fp16 compute:
# with no scaling, and with a dynamic loss scaler.

# %%
steps = 6 if QUICK else 40
runs = {
    "fp32": amp.underflow_experiment(steps, dtype=torch.float32),
    "fp16, no scaling": amp.underflow_experiment(steps, dtype=torch.float16),
    "fp16 + dynamic loss scaling": amp.underflow_experiment(
        steps, dtype=torch.float16, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=20)),
}
for label, run in runs.items():
    zeros = sum(run["zero_fraction"]) / len(run["zero_fraction"])
    plt.plot(run["loss"], label=f"{label} ({zeros:.0%} of gradient elements zero)")
plt.yscale("log")
plt.xlabel("step")
plt.ylabel("loss")
plt.legend()
plt.show()

# %% [markdown]
# Without scaling, almost every gradient element is exactly zero in fp16, so the optimizer has
# nothing to apply and the loss stays flat. The remedy (Micikevicius et al., 2018) is to multiply
# the loss by a large factor $S$ before `backward()`: by the chain rule every gradient is
# multiplied by $S$ too, lifting it out of the underflow zone; then, before the optimizer uses
# them, divide the (fp32) gradients by $S$ again. A *static* $S$ must be guessed. A *dynamic* scaler
# adapts it:
#
# - start high ($2^{16}$);
# - after `backward()`, **unscale** the gradients and check them for inf/NaN: a scale too high
#   made something overflow;
# - if so, **skip** the optimizer step (the update would be garbage), and **back off**: $S \leftarrow
#   S \cdot 0.5$;
# - otherwise step, and after `growth_interval` consecutive clean steps **grow**: $S \leftarrow S
#   \cdot 2$, to stay as high as is safe.
#
# Gradient clipping must see the *true* gradients, so it goes after unscaling; and unscaling twice
# would divide twice, so it is allowed once per step.
#
# Write `DynamicLossScaler` with the same contract as `torch.amp.GradScaler`:
# `scale(outputs)` (a tensor, or a list/tuple of tensors), `unscale_(optimizer)`,
# `step(optimizer, *args, **kwargs)` (unscales first if you have not; returns what
# `optimizer.step` returns, or `None` when it skips), `update()` and `get_scale()`. The grader
# runs it step for step against `torch.amp.GradScaler` on hidden runs with overflows injected at
# hidden steps: the scale after every step, the skipped steps and the final parameters must be the
# same (GradScaler itself, and the ops it unscales and updates with, are refused while yours runs). (One more pitfall of the real thing: `torch.amp.GradScaler()` *without* a device argument
# quietly disables itself on a machine without CUDA. Always name the device.)

# %% nbgrader={"grade_id": "scaler_code", "solution": true}
class DynamicLossScaler:
    """Dynamic loss scaling by hand, with torch.amp.GradScaler's contract."""

    def __init__(self, device="cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be above 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval}")
        self.device = device
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf = False

    def get_scale(self):
        return self._scale

    def scale(self, outputs):
        ### BEGIN SOLUTION
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, not {type(outputs).__name__}")
        ### END SOLUTION

    def unscale_(self, optimizer):
        ### BEGIN SOLUTION
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called since the last update()")
        # Powers of two (and the default factors) make 1/scale exact in fp32, as GradScaler's is.
        inverse = 1.0 / self._scale
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.mul_(inverse)
                found = found or not bool(torch.isfinite(p.grad).all())
        self._found_inf, self._unscaled = found, True
        ### END SOLUTION

    def step(self, optimizer, *args, **kwargs):
        ### BEGIN SOLUTION
        if not self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)
        ### END SOLUTION

    def update(self):
        ### BEGIN SOLUTION
        if self._found_inf:
            self._scale *= self.backoff_factor
            clean_steps = 0
        else:
            clean_steps = self._growth_tracker + 1
            if clean_steps == self.growth_interval:
                grown = self._scale * self.growth_factor
                # GradScaler keeps its scale in fp32 and refuses to grow it to inf.
                if grown <= torch.finfo(torch.float32).max:
                    self._scale = grown
                clean_steps = 0
        self._growth_tracker = clean_steps
        self._unscaled = self._found_inf = False
        ### END SOLUTION


# %% nbgrader={"grade_id": "loss_scaler", "grade": true, "points": 3}
import torch
from torch import nn


def _scaler_run(scaler, overflow_at, clip=None, steps=10, seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    now = [0]
    net[0].weight.register_hook(lambda g: g * float("inf") if now[0] in overflow_at else g)
    data = torch.randn(steps, 8, 6, generator=torch.Generator().manual_seed(seed))
    scales = []
    for now[0] in range(steps):
        loss = net(data[now[0]]).pow(2).mean()
        scaler.scale(loss).backward()  # the scaler under test scales, unscales, steps and updates
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        scaler.step(opt)
        scaler.update()  # once per iteration, skipped step or not
        opt.zero_grad(set_to_none=True)
        scales.append(float(scaler.get_scale()))
    return scales, [p.detach().clone() for p in net.parameters()]


def _compare_scalers(overflow_at, clip=None, **kwargs):
    mine = _scaler_run(DynamicLossScaler("cpu", **kwargs), overflow_at, clip)
    ref = _scaler_run(torch.amp.GradScaler("cpu", **kwargs), overflow_at, clip)
    assert mine[0] == ref[0], f"scales after each step {mine[0]}, GradScaler gives {ref[0]}"
    for a, b in zip(mine[1], ref[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


_compare_scalers({2}, init_scale=2.0**8, growth_interval=3)
_compare_scalers({0, 1, 5}, clip=0.5, init_scale=2.0**10, growth_interval=2)
try:
    _s = DynamicLossScaler("cpu")
    _opt = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    _s.unscale_(_opt)
    _s.unscale_(_opt)
    raise AssertionError("a second unscale_() before update() must raise RuntimeError")
except RuntimeError:
    pass
print("loss_scaler: visible tests passed")
### BEGIN HIDDEN TESTS
_compare_scalers({3, 4, 8}, init_scale=2.0**6, growth_interval=2, growth_factor=4.0, backoff_factor=0.25)
_compare_scalers({1, 6}, clip=0.1, init_scale=2.0**12, growth_interval=4)
### END HIDDEN TESTS

# %% [markdown]
# ## 4. The AMP training step
#
# Put the pieces together in the order that matters: the forward under `torch.autocast`, the
# scaled backward, **unscale before clipping**, a step that the scaler may skip, one `update()` per
# step. Write `train_step` for any scaler with GradScaler's contract (the grader passes
# `torch.amp.GradScaler`, so this item does not depend on the previous one). `max_norm` is the
# clipping threshold of `torch.nn.utils.clip_grad_norm_`. Return the loss as a Python float.

# %% nbgrader={"grade_id": "train_step_code", "solution": true}
def train_step(model, optimizer, scaler, x, y, loss_fn, max_norm, dtype=torch.bfloat16):
    ### BEGIN SOLUTION
    with torch.autocast(device_type=x.device.type, dtype=dtype):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
    ### END SOLUTION


# %% nbgrader={"grade_id": "amp_train_step", "grade": true, "points": 2}
import torch
import torch.nn.functional as F
from torch import nn


def _amp_run(step_fn, clip, overflow_at=(), steps=6):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    now = [0]
    net[0].weight.register_hook(lambda g: g * float("inf") if now[0] in overflow_at else g)
    data = torch.randn(steps, 16, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(steps, 16, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for now[0] in range(steps):
        losses.append(step_fn(net, opt, gs, data[now[0]], target[now[0]], F.mse_loss, clip))
    return losses, [p.detach().clone() for p in net.parameters()], gs.get_scale()


# What the course's reference step leaves after these six steps (its own code is not in your copy of
# the package): the final scale, and each parameter tensor's sum and norm.
_EXPECTED = {
    (0.2, ()): (32768.0, [(-1.7786, 2.3218), (0.688, 0.7488), (-1.8201, 1.1706), (0.0851, 0.0982)]),
    (0.05, (1, 2)): (2048.0, [(-1.8098, 2.3259), (0.7027, 0.7498), (-1.8673, 1.1834), (0.0686, 0.103)]),
}


def _check_amp(clip, overflow_at=()):
    losses, params, scale = _amp_run(lambda *a: train_step(*a, dtype=torch.bfloat16), clip, overflow_at)
    want_scale, want_params = _EXPECTED[(clip, tuple(overflow_at))]
    assert all(isinstance(v, float) for v in losses), "train_step must return the loss as a float"
    assert scale == want_scale, f"final scale {scale}, expected {want_scale}"
    for i, (p, (total, norm)) in enumerate(zip(params, want_params)):
        got = (float(p.sum()), float(p.norm()))
        assert abs(got[0] - total) < 2e-3 + 1e-2 * abs(total) and abs(got[1] - norm) < 2e-3 + 1e-2 * norm, (
            f"parameter {i}: sum {got[0]:.4f} and norm {got[1]:.4f}, expected {total:.4f} and {norm:.4f}: "
            "is clipping after unscale_?")


_check_amp(clip=0.2)
print("amp_train_step: visible tests passed")
### BEGIN HIDDEN TESTS
_check_amp(clip=0.05, overflow_at=(1, 2))
### END HIDDEN TESTS

# %% [markdown]
# ## 5. Bytes per parameter
#
# What does training a model of $P$ parameters cost in memory, before activations? Every parameter
# carries
#
# - its **value** in the parameter dtype (the one the model computes with);
# - its **gradient**, in the gradient dtype (usually the parameter's; fp32 when gradients are
#   accumulated in fp32);
# - optionally an **fp32 master copy** (mixed precision: the optimizer updates the master, the
#   16-bit copy is re-made from it);
# - the **optimizer state**: none for plain SGD, one momentum buffer for SGD with momentum, two
#   moments for Adam and AdamW.
#
# fp32 Adam therefore costs $4+4+8 = 16$ bytes per parameter; fp16 parameters and gradients with
# an fp32 master and fp32 moments also cost $2+2+4+8 = 16$: mixed precision saves activation memory
# and time, not optimizer memory. A 7-billion-parameter model at 16 B/parameter needs 112 GB before
# a single activation. Quantised optimizers store the moments in 8 bits: one byte per element
# plus one fp32 scale per block of elements (on paper here).
#
# Write `bytes_per_param(recipe)`. A recipe is a dict such as
# `{"param": "bf16", "grad": "fp32", "master": "fp32", "optimizer": "adamw", "moments": "fp32"}`:
#
# - `param`, `grad`: one of `fp32`, `tf32` (stored in 4 bytes), `fp16`, `bf16`, `fp8_e4m3`, `fp8_e5m2`;
# - `master`: `None` or one of those (a master copy costs its own size, whatever the parameter's);
# - `optimizer`: `sgd` (no state), `sgd_momentum` (one buffer), `adam` or `adamw` (two moments);
# - `moments`: the dtype of the optimizer state: `fp32`, `bf16`, `fp16`, or `int8`, which costs
#   one byte plus one fp32 scale per `recipe["block"]` elements (2048 if absent).
#
# Return a dict of bytes per parameter with keys `params`, `grads`, `master`, `optimizer` and
# `total`.

# %% nbgrader={"grade_id": "memory_code", "solution": true}
ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


def bytes_per_param(recipe):
    ### BEGIN SOLUTION
    moments = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}[recipe["optimizer"]]
    if recipe["moments"] == "int8":
        per_moment = 1 + 4 / recipe.get("block", 2048)
    else:
        per_moment = ELEMENT_BYTES[recipe["moments"]]
    parts = {
        "params": ELEMENT_BYTES[recipe["param"]],
        "grads": ELEMENT_BYTES[recipe["grad"]],
        "master": 0 if recipe["master"] is None else ELEMENT_BYTES[recipe["master"]],
        "optimizer": moments * per_moment,
    }
    parts["total"] = sum(parts.values())
    return parts
    ### END SOLUTION


# %% nbgrader={"grade_id": "bytes_per_param", "grade": true, "points": 2}
_fp32_adam = {"param": "fp32", "grad": "fp32", "master": None, "optimizer": "adam", "moments": "fp32"}
assert bytes_per_param(_fp32_adam)["total"] == 16, bytes_per_param(_fp32_adam)
_mixed = {"param": "fp16", "grad": "fp16", "master": "fp32", "optimizer": "adamw", "moments": "fp32"}
assert bytes_per_param(_mixed) == {"params": 2, "grads": 2, "master": 4, "optimizer": 8, "total": 16}, bytes_per_param(_mixed)
_sgd = {"param": "bf16", "grad": "bf16", "master": None, "optimizer": "sgd", "moments": "fp32"}
assert bytes_per_param(_sgd)["total"] == 4, bytes_per_param(_sgd)
print("bytes_per_param: visible tests passed")
### BEGIN HIDDEN TESTS
_q = {"param": "bf16", "grad": "bf16", "master": "fp32", "optimizer": "adam", "moments": "int8", "block": 256}
assert abs(bytes_per_param(_q)["total"] - (2 + 2 + 4 + 2 * (1 + 4 / 256))) < 1e-9, bytes_per_param(_q)
_m = {"param": "fp8_e4m3", "grad": "bf16", "master": "fp32", "optimizer": "sgd_momentum", "moments": "bf16"}
assert bytes_per_param(_m)["total"] == 1 + 2 + 4 + 2, bytes_per_param(_m)
### END HIDDEN TESTS

# %% [markdown]
# The calculator against the bytes a real model and optimizer allocate. `amp.training_bytes` walks
# the tensors that exist after one step (parameters, gradients, master copies, optimizer state),
# counts each storage once, and divides by the number of parameters (the 0-dimensional step
# counters are reported apart, in `step_bytes`). The second model keeps bf16 weights, fp32 master
# copies that AdamW updates, and its gradients in fp32 on the masters: 18 bytes.

# %%
net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))


def one_step(model, opt, masters=()):
    model(torch.randn(4, 256, dtype=next(model.parameters()).dtype)).float().pow(2).mean().backward()
    if masters:
        for master, p in zip(masters, model.parameters()):
            master.grad = p.grad.float()
    opt.step()


fp32_net = net
opt = torch.optim.AdamW(fp32_net.parameters())
one_step(fp32_net, opt)
print("fp32 AdamW:                       ", amp.training_bytes(fp32_net, opt))
bf16_net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).bfloat16()
masters = [p.detach().float().requires_grad_() for p in bf16_net.parameters()]
opt = torch.optim.AdamW(masters)
one_step(bf16_net, opt, masters)
for p in bf16_net.parameters():
    p.grad = None  # moved to the masters in fp32
print("bf16 params, fp32 masters, AdamW: ", amp.training_bytes(bf16_net, opt, masters=masters))
print("your calculator for both:         ",
      bytes_per_param({"param": "fp32", "grad": "fp32", "master": None, "optimizer": "adamw", "moments": "fp32"})["total"],
      bytes_per_param({"param": "bf16", "grad": "fp32", "master": "fp32", "optimizer": "adamw", "moments": "fp32"})["total"])

# %% [markdown]
# ### Where the bytes come from: memory pools
#
# The bytes above fall into two kinds. **Persistent** tensors (weights, gradients, optimizer state,
# masters) are allocated once and live for the whole run. **Temporary** ones (activations, the
# outputs of every op, workspace) are allocated and freed in every step, thousands of times a
# second. Asking the system for memory each time would cost more than many ops do: on a GPU,
# `cudaMalloc` and `cudaFree` take far longer than a small kernel, and `cudaFree` synchronizes the
# device. So PyTorch keeps a **pool**, the caching allocator: a freed block goes back to PyTorch,
# not to the driver, and the next request of a similar size reuses it. `torch.cuda.memory_allocated()`
# counts the bytes tensors hold; `memory_reserved()` the bytes the pool holds, which only grows
# until `torch.cuda.empty_cache()`.
#
# A pool has costs of its own. Blocks are split and rounded, so temporaries of changing sizes
# leave holes between long-lived blocks (fragmentation: an out-of-memory error while
# `reserved - allocated` is large). `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lets
# segments grow instead of multiplying, and `torch.cuda.MemPool` gives chosen tensors a pool of
# their own (CUDA graphs use private pools for the same reason: their addresses must not move).
#
# The CPU shows the same effect with the C library's allocator as the pool. glibc's `malloc` reuses
# freed blocks up to its mmap threshold (at most 32 MiB); a larger block is fresh pages from the
# kernel every time, and writing them faults each page in. An op that writes into a buffer it
# reuses (`out=`) skips all of that:

# %%
for mb in ((64,) if QUICK else (1, 16, 64)):
    cmp = memory.fresh_vs_reused(mb, reps=3 if QUICK else 15)
    fresh, reused = cmp.candidate.median, cmp.baseline.median
    print(f"{mb:>3} MB: a fresh output {fresh * 1e3:7.2f} ms, a reused one {reused * 1e3:7.2f} ms "
          f"({fresh / reused:.2f}x the time)")
steps = memory.caching_allocator_steps()
if steps is None:
    print("the caching allocator's figures need a GPU")
else:
    for i, row in enumerate(steps):
        print(f"step {i}: allocated {row['allocated'] >> 20} MiB, reserved {row['reserved'] >> 20} MiB, "
              f"cudaMalloc calls so far {row['driver_mallocs']}")

# %% [markdown]
# On the 2-core machine, a fresh 64 MB output took about three times as long as a reused one
# (92 ms against 31 ms in one run), while at 1 and 16 MB the two were within 5%: the pool served
# them. On a GPU, read the caching allocator's table: after which step does `reserved` stop
# growing, and how many `cudaMalloc` calls does the loop make once the pool holds a block of the
# temporary's size?

# %% [markdown]
# ## 6. AdamW: a loop, multi-tensor ops, one kernel
#
# AdamW (Loshchilov and Hutter, 2019) keeps two moments per parameter and, at step $t$, with
# gradient $g$:
#
# $$w \leftarrow w(1 - \eta\lambda),\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
#   v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
#   w \leftarrow w - \frac{\eta}{1-\beta_1^t}\cdot\frac{m}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon}.$$
#
# The two denominators $1-\beta^t$ are the **bias corrections**: the moments start at zero, so
# early on they underestimate the gradient's statistics by exactly that factor. $t$ counts from 1.
#
# Per element this is a dozen FLOPs on 16 bytes read and 12 written (fp32 weight, gradient and
# two moments): it is memory-bound, and small. A transformer has hundreds of parameter tensors, many
# of them tiny (biases, norms). Written as a Python loop over tensors, each of the ~10 operations
# per tensor is a kernel launch: for 200 tensors, 2000 launches of a few microseconds each, most of
# them moving almost nothing. Three ways to run the same math, all in `fastdl_lab.optim`:
#
# - `adamw_ref`: the loop over tensors, operation by operation (the reference);
# - `adamw_foreach`: `torch._foreach_*` ops take a *list* of tensors per call, so the Python calls
#   per step do not grow with the number of tensors. On a GPU each call launches one kernel per
#   group of tensors (`multi_tensor_apply`, in chunks of 65,536 elements): a CUDA 12 build puts
#   up to 110 tensors in a launch for an op on one list, 36 for an op on four, and at most 320
#   chunks; a CUDA 13 build allows 770, 252 and 2,240. On a CPU each call loops over the tensors
#   in C++, one op per tensor;
# - `fused_adamw`: **one Triton kernel for the whole list**, every operation fused: each element is
#   read once and written once.

# %%
shapes = [(256, 256)] * 4 + [(256,)] * 60
if QUICK:
    shapes = [(64, 64)] * 2 + [(64,)] * 10
ps = [torch.randn(s) for s in shapes]
gs = [torch.randn(s) for s in shapes]
ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
cmp = timing.compare(lambda: optim.adamw_foreach(ps, gs, ms, vs, 1, **hyper),
                     lambda: optim.adamw_ref(ps, gs, ms, vs, 1, **hyper), reps=3 if QUICK else 10)
print(f"loop over {len(shapes)} tensors: {cmp.baseline.median * 1e3:.2f} ms per step; "
      f"foreach: {cmp.candidate.median * 1e3:.2f} ms ({cmp.speedup:.2f}x)")

# %% [markdown]
# ### Multi-tensor apply
#
# One launch must reach tensors that live at unrelated addresses. The trick (NVIDIA's Apex calls it
# *multi-tensor apply*) is to pass the kernel **tables**: for each list (parameters, gradients,
# moments, masters), an int64 tensor of the tensors' addresses; the length of each tensor; and a
# **chunk table** that cuts every tensor into blocks of `BLOCK` elements and says, for program
# `pid`, which tensor (`chunk_tensor[pid]`) and which first element (`chunk_start[pid]`) it owns.
# Inside the kernel an address becomes a typed pointer with
# `tl.load(param_addrs + t).to(tl.pointer_type(tl.float32))`. `optim.multi_tensor_table` builds the
# tables with a fixed number of torch calls however many tensors there are:

# %%
table = optim.multi_tensor_table([[torch.zeros(5), torch.zeros(600), torch.zeros(3)]], 256)
print("numels      ", table.numels.tolist())
print("chunk_tensor", table.chunk_tensor.tolist())
print("chunk_start ", table.chunk_start.tolist())

# %% [markdown]
# Write the kernel. One program handles one chunk: find its tensor and first element, turn the
# addresses into pointers, load gradient and moments (and the weight, from the fp32 master when
# `HAS_MASTER`, otherwise from the parameter itself) in fp32, apply the update, store the moments,
# the master, and the parameter in its own dtype (`PARAM_DTYPE`: fp32, fp16 or bf16; gradients have
# the parameter's dtype; moments and masters are always fp32). Compute the bias corrections from
# `step` inside the kernel: $\beta^t = 2^{t \log_2 \beta}$ (`tl.exp2`, `tl.log2`). When
# `HAS_MASTER` is false, `master_addrs` holds the parameter table and must not be written. The
# launcher `optim.fused_adamw(..., kernel=fused_adamw_kernel)` builds the tables and launches it,
# once per parameter dtype.

# %% nbgrader={"grade_id": "adamw_kernel_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def fused_adamw_kernel(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, master_addrs, numels,
                       chunk_tensor, chunk_start, step, lr, beta1, beta2, eps, weight_decay,
                       PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    offs = tl.load(chunk_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    p_ptr = tl.load(param_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    m_ptr = tl.load(exp_avg_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_addrs + t).to(tl.pointer_type(tl.float32))
    if HAS_MASTER:
        w_ptr = tl.load(master_addrs + t).to(tl.pointer_type(tl.float32))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)

    w = w * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    w = w - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(PARAM_DTYPE), mask=mask)
    ### END SOLUTION


# %% nbgrader={"grade_id": "fused_adamw", "grade": true, "points": 4}
import torch

from fastdl_lab import checks, device, optim

_dev = "cuda" if device.has_gpu() else "cpu"


def _check_fused(shapes, dtype, master, steps=5, seed=0, block=256):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(*s, generator=gen) for s in shapes]
    grads = [[torch.randn(*s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    params = [t.to(dtype).to(_dev) for t in init]
    masters = [t.clone().to(_dev) for t in init] if master else None
    m = [torch.zeros(s, device=_dev) for s in shapes]
    v = [torch.zeros(s, device=_dev) for s in shapes]
    ref = [t.clone().requires_grad_() for t in init]
    torch_opt = torch.optim.AdamW(ref, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                  weight_decay=hp["weight_decay"], foreach=False)
    for t, step_grads in enumerate(grads, 1):
        optim.fused_adamw(params, [g.to(_dev) for g in step_grads], m, v, t, masters=masters,
                          kernel=fused_adamw_kernel, block=block, **hp)
        for r, g in zip(ref, step_grads):
            r.grad = g.float()
        torch_opt.step()
    for i, r in enumerate(ref):
        if master:
            checks.assert_close(masters[i].cpu(), r.detach(), name=f"master {i} ({shapes[i]})", atol=2e-5, rtol=1e-4)
        tol = 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
        checks.assert_close(params[i].float().cpu(), r.detach().to(dtype).float(), name=f"param {i} ({shapes[i]}, {dtype})",
                            atol=tol, rtol=tol)


_check_fused([(1,), (37,), (5, 7), (300,)], torch.float32, master=False)
_check_fused([(17,), (260,)], torch.bfloat16, master=True)
print("fused_adamw: visible tests passed")
### BEGIN HIDDEN TESTS
_check_fused([(3, 4, 5), (1030,), (2,)], torch.float32, master=False, seed=1, block=128)
_check_fused([(9, 9), (513,)], torch.float16, master=True, seed=2)
### END HIDDEN TESTS

# %% [markdown]
# ### The optimizer around the kernel
#
# A kernel is not yet an optimizer. `FusedAdamW` wraps it in `torch.optim.Optimizer`'s contract:
# parameter groups with their hyper-parameters (`lr`, `betas`, `eps`, `weight_decay`), per-parameter
# state created on the first step (`exp_avg`, `exp_avg_sq`, a step count), parameters without a
# gradient skipped, and `step(closure=None)` returning the closure's loss. Its `step` must launch
# `fused_adamw_kernel` **once per parameter group**, through `multi_tensor_table`, for fp32
# parameters. The grader runs it on lists of 8 and of 64 tensors, and on two parameter groups with
# their own learning rate and weight decay where some tensors never get a gradient, and compares
# the parameters with `torch.optim.AdamW`'s (one point). It also replaces `fused_adamw_kernel` by a
# counter while your optimizer runs: one launch per step for one group, however many tensors, and
# no per-tensor work growing with the list (it counts the torch operations your step dispatches on
# non-scalar tensors). Those counts are taken inside your own process, so they carry the other
# point only. torch's fused and `torch._foreach` kernels are refused while your optimizer runs.

# %% nbgrader={"grade_id": "adamw_optimizer_code", "solution": true}
from fastdl_lab.optim import multi_tensor_table

BLOCK = 1024


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        ### BEGIN SOLUTION
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.dtype != torch.float32:
                    raise TypeError(f"FusedAdamW updates fp32 parameters, got {p.dtype}")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
            states = [self.state[p] for p in params]
            grads = [p.grad.contiguous() for p in params]
            table = multi_tensor_table([params, grads, [s["exp_avg"] for s in states],
                                        [s["exp_avg_sq"] for s in states], params], BLOCK)
            beta1, beta2 = group["betas"]
            fused_adamw_kernel[(table.n_chunks,)](
                *table.addrs, table.numels, table.chunk_tensor, table.chunk_start, states[0]["step"],
                group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
                PARAM_DTYPE=tl.float32, HAS_MASTER=False, BLOCK=BLOCK)
        return loss
        ### END SOLUTION


# %% nbgrader={"grade_id": "fused_adamw_launches", "grade": true, "points": 2}
import torch
from torch import nn


def _launches(n_tensors, steps=3):
    calls = [0]
    real = fused_adamw_kernel

    class Counter:
        def __getitem__(self, grid):
            calls[0] += 1
            return real[grid]

    globals()["fused_adamw_kernel"] = Counter()
    try:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(int(torch.randint(1, 50, ())))) for _ in range(n_tensors)]
        ref = [p.detach().clone().requires_grad_() for p in params]
        opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
        torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
        per_step = []
        for _ in range(steps):
            for p, r in zip(params, ref):
                p.grad = torch.randn_like(p)
                r.grad = p.grad.clone()
            before = calls[0]
            opt.step()
            torch_opt.step()
            per_step.append(calls[0] - before)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.detach(), r.detach(), atol=2e-5, rtol=1e-4)
        return per_step
    finally:
        globals()["fused_adamw_kernel"] = real


assert _launches(5) == [1, 1, 1], f"launches per step: {_launches(5)}"
print("fused_adamw_launches: visible tests passed")
### BEGIN HIDDEN TESTS
assert _launches(40) == [1, 1, 1], f"launches per step with 40 tensors: {_launches(40)}"
### END HIDDEN TESTS

# %% [markdown]
# On the CPU there are no launches to save: each torch op is a function call, and the loop and
# the multi-tensor ops cost about the same (`benchmarks/results/optim.csv` has the rows, with
# PyTorch's own `fused=True`). The point of fusion shows on a GPU.
#
# What the compiler made of your kernel: the PTX for a Hopper GPU, compiled here without one. One
# price of multi-tensor apply shows in it: a pointer read from a table carries no alignment the
# compiler can prove, so the data loads are scalar (`ld.global.b32`), not the 128-bit vector loads
# a kernel over one contiguous buffer gets.
#
# The package's own kernel wins them back in two steps. The launcher checks that every address
# in the tables is a multiple of 16 bytes (PyTorch's allocations are; a view into a larger tensor
# may not be) and passes that as a constexpr; the kernel then vouches for it with
# `tl.multiple_of(ptr, 16)`. And since a mask that varies inside a vector forces scalar accesses,
# every chunk but a tensor's last takes a branch without one. On sm_90 that makes every access
# of a whole chunk a 16-byte `ld.global.v4.b32` / `st.global.v4.b32`. A wrong promise is worse
# than none: a vector access to a misaligned address faults, hence the check on the host.

# %%
if QUICK:  # a compile to PTX, a second per graded run, and the grade needs none of it
    print("the PTX of your kernel is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    print(triton_aot.ptx_summary(optim.ptx(90, kernel=fused_adamw_kernel)))

# %% [markdown]
# ### Letting the compiler fuse it: `torch.compile` of `optimizer.step`
#
# The alternative to writing the kernel is to compile torch's own optimizer: wrap the call to
# `opt.step()` in `torch.compile`, and Inductor turns its foreach ops into generated code (on a
# GPU Triton kernels that each update many tensors; on a CPU C++ loops). Three limits are worth knowing
# before relying on it:
#
# - **Compile time.** The first step traces the whole optimizer and generates code: seconds to
#   minutes, paid again in every new process (Inductor's cache shortens it).
# - **Recompiles.** Dynamo guards on the Python values it read while tracing. A float learning
#   rate becomes a constant of the graph, so the first time a scheduler changes it, the step is
#   traced again; give the optimizer a 0-d tensor (`lr=torch.tensor(1e-3)`) and the rate is an
#   input of one graph instead (PyTorch's compiled-optimizer recipe says the same).
# - **What it cannot fuse.** It generates the same elementwise work your kernel does, but the
#   grouping into launches is Inductor's, and an optimizer with data-dependent Python (a `.item()`,
#   a branch on a tensor's value) breaks the graph.
#
# `optim.compiled_step_graphs` counts the graphs Dynamo makes for `torch.optim.AdamW` under a
# `LinearLR` schedule, with a backend that only counts (no code generated), so the count is cheap:

# %%
if QUICK:
    print("skipped under FASTDL_QUICK: tracing the optimizer takes several seconds")
else:
    for as_tensor in (False, True):
        graphs = optim.compiled_step_graphs(lr_as_tensor=as_tensor)
        steps = ", ".join(f"{s:.3f}" for s in graphs["seconds"])
        kind = "a tensor" if as_tensor else "a float "
        print(f"lr as {kind}: {graphs['graphs']} graph(s); seconds per step: {steps}")
# Generated code too: True pays Inductor's compile (74 s for the first step on a busy 2-core machine).
WITH_INDUCTOR = False
if WITH_INDUCTOR and not QUICK:
    inductor = optim.compiled_step_graphs(True, steps=3, backend="inductor")
    print("inductor, seconds per step:", ", ".join(f"{s:.3f}" for s in inductor["seconds"]))

# %% [markdown]
# ### On a GPU: fused against `torch._foreach`
#
# Per step, every variant moves the same bytes; the fused kernel moves them in one pass and one
# launch. The graded comparison (GPU profiles) times your kernel against `optim.adamw_foreach`
# on a list of transformer-sized tensors, interleaved in one process.

# %% nbgrader={"grade_id": "fused_adamw_speed", "grade": true, "points": 2}
import torch

from fastdl_lab import device, optim, timing

if device.has_gpu():
    _shapes = [(4096, 4096)] * 4 + [(4096,)] * 16
    _p = [torch.randn(s, device="cuda") for s in _shapes]
    _g = [torch.randn(s, device="cuda") for s in _shapes]
    _m, _v = [torch.zeros_like(t) for t in _p], [torch.zeros_like(t) for t in _p]
    _hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    _cmp = timing.compare(lambda: optim.fused_adamw(_p, _g, _m, _v, 1, kernel=fused_adamw_kernel, **_hp),
                          lambda: optim.adamw_foreach(_p, _g, _m, _v, 1, **_hp))
    print(f"your fused AdamW vs torch._foreach: {_cmp.speedup:.2f}x (95% CI {_cmp.ci_low:.2f}-{_cmp.ci_high:.2f})")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## Summary
#
# - Exponent bits buy range, mantissa bits buy precision. fp16 overflows at 65504 and flushes small
#   gradients to zero; bf16 has fp32's range and rounds away small updates; fp8 needs both a
#   careful format choice and scaling.
# - Mixed precision computes in 16 bits where rounding is harmless (matmuls, with fp32
#   accumulation) and keeps fp32 where it is not (reductions, the loss, the master weights).
# - fp16 needs loss scaling: multiply the loss, unscale the gradients before anything looks at
#   them, skip steps that overflowed, back off and grow the scale. bf16 does not.
# - Mixed precision does not shrink the optimizer: Adam costs 16 bytes per parameter either way.
# - A step over hundreds of small tensors is launch-bound: multi-tensor apply updates them all in
#   one launch, and fusing the update reads and writes each element once.
