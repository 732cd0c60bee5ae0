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
# # Lab 09 — Custom ops and quantisation: beyond Python, below 16 bits
#
# Two ways past what the framework gives you. When no existing op does what you need fast enough,
# write one: in C++ (no Python interpreter between the small ops of a cell), in CUDA (one fused
# kernel instead of a chain of launches), and register it so the compiler treats it like any
# built-in op. When 16 bits are still too many, go to 8 (or 4): integer codes with a scale, an
# integer matrix multiply, and training that knows about the rounding. In this lab you will:
#
# 1. write the forward and backward of a recurrent cell (LLTM) in C++, build it with torch's
#    `cpp_extension` (as `load_inline` would), and check the backward against autograd *(section 1,
#    about 90 minutes; graded: `cpp_lltm`, 4 points)*; see its CUDA version compile for A100 and
#    H100 without a GPU, and the cell registered as a `torch.library` op that `torch.compile`
#    traces without a graph break;
# 2. quantise weights to int8, per tensor and per channel, and measure the error on a trained
#    layer *(section 2, about 35 minutes; graded: `per_channel_int8`, 2 points)*;
# 3. write an int8 × int8 → int32 matrix multiply in Triton with dequantisation in the epilogue,
#    bit-exact *(section 3, about 70 minutes; graded: `int8_matmul`, 4 points; on GPU profiles
#    `int8_matmul_speed`, 2 points)*;
# 4. train with fake quantisation and the straight-through estimator, and beat post-training
#    quantisation *(section 4, about 45 minutes; graded: `qat_beats_ptq`, 3 points)*;
# 5. fold BatchNorm into the preceding Linear for inference and measure what `torch.compile` adds
#    *(section 5, about 15 minutes)*;
# 6. distil a large model into a small one for fast single requests, against the same small model
#    trained on labels *(section 6, about 25 minutes)*;
# 7. see when skipping zeros pays: a sparse product against a dense one as the density falls, and
#    the 2:4 pattern GPUs accelerate *(section 7, about 15 minutes)*.
#
# **How this lab is graded.** The grader takes your C++ source (the string `LLTM_CPP`), your
# functions and classes, and your kernel out of their cells and runs each on its own: the C++ is
# compiled in the sandbox, in a folder of its own, and a build error is reported with the
# compiler's first error line. Python functions see only `math`, `torch` and `F`: no imports
# inside them. Inputs are hidden and drawn per student.
#
# **Time:** about 5 hours for a student who has done the labs before it, by section in minutes: §1
# 90; §2 35; §3 70; §4 45; §5 15; §6 25; §7 15. Graded code regions take most of it; the estimates
# are the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import inspect
import math  # noqa: F401  (one of the grader's names, for your cells)

import torch
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks, timing
from fastdl_lab.custom import lltm, sources
from fastdl_lab.quant import formats, fusion, training, w8a8



DEVICE = "cuda" if device.has_gpu() else "cpu"
QUICK = device.quick()  # the grader's run of the notebook: ungraded experiments at tiny sizes

# %% [markdown]
# ## 1. A custom op in C++: the LLTM cell
#
# The LLTM ("long-long-term memory") cell is a small recurrent cell. With $X = [h_{t-1}, x_t]$:
#
# $$g = X W^\top + b = [g_i, g_o, g_c], \quad i = \sigma(g_i),\ o = \sigma(g_o),\ c' = \mathrm{ELU}(g_c)$$
# $$C_t = C_{t-1} + c' \odot i, \qquad h_t = \tanh(C_t) \odot o$$
#
# In Python each of those is a separate op: a kernel launch on a GPU, and on any device a trip
# through the interpreter and the dispatcher. `lltm.lltm_ref` is the cell as autograd sees it;
# `lltm.PYTHON_OPS` is the same cell written as a forward that returns what the backward needs,
# and a backward written by hand (no autograd graph) — the contract your C++ follows:
#
# ```
# lltm_forward(input, weights, bias, old_h, old_cell)
#     -> [new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights]
# lltm_backward(grad_h, grad_cell, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights, weights)
#     -> [d_old_h, d_input, d_weights, d_bias, d_old_cell]
# ```

# %%
print(inspect.getsource(lltm.lltm_backward))

# %% [markdown]
# The chain rule by hand: $\partial h/\partial C = o\,(1 - \tanh^2 C)$ joins the gradient that
# arrives at $C_t$ directly; the sigmoid's derivative is $s(1-s)$ of the saved gate; ELU's is 1
# above zero and $e^z = \mathrm{ELU}(z) + 1$ below. `lltm.check_ops` compares any implementation's
# outputs and all five gradients with autograd on the reference:

# %%
inputs = lltm.make_inputs(16, 32, 128, seed=0)
lltm.check_ops(lltm.PYTHON_OPS, inputs)
print("the hand-written Python backward agrees with autograd")

# %% [markdown]
# ### Your C++ extension
#
# Write `lltm_forward` and `lltm_backward` in C++ with the ATen API: `torch::cat`, `torch::addmm`,
# `.chunk(3, /*dim=*/1)`, `torch::sigmoid`, `torch::elu`, `torch::tanh`, `torch::where`,
# `torch::ones_like`, `.t()`, `.mm(...)`, `.sum(0)`, `.narrow(dim, start, length)`. The cell below
# holds the whole source as a string. `sources.build_cpp` builds it as `load_inline` would: it adds
# `#include <torch/extension.h>` before it and the Python bindings of the two functions. One thing
# differs, and it makes a build take about 5 s instead of 20 on two cores: `torch/extension.h` is
# torch's tensor API alone (`torch/types.h`: ATen, `torch::` tensors, c10), and the bindings, the
# same for every source, are compiled once per machine. So keep the two signatures (tensors by
# value or by `const &`, a `std::vector<torch::Tensor>` back). In each body, replace the two
# placeholder lines (Python's `raise NotImplementedError()`, which is not C++) with your code. An
# unchanged source is not rebuilt.
#
# Two things the grader checks besides the numbers: it builds, and it only computes. The grader
# compiles the source itself and reads what the compiler saw, every macro expanded, and what the
# compiled object calls: no files, processes, environment, dynamic loading or Python API (the
# bindings are generated for you), and no autograd: the backward is yours, written by hand.
# The outputs of the backward must be separate tensors (two `mm`s rather than slices of one
# result): `torch.library` refuses outputs that share storage.

# %% nbgrader={"grade_id": "cpp_code", "solution": true}
LLTM_CPP = r"""
#include <torch/extension.h>
#include <vector>

std::vector<torch::Tensor> lltm_forward(torch::Tensor input, torch::Tensor weights, torch::Tensor bias,
                                        torch::Tensor old_h, torch::Tensor old_cell) {
  // ### BEGIN SOLUTION
  auto X = torch::cat({old_h, input}, 1);
  auto gate_weights = torch::addmm(bias, X, weights.t());
  auto gates = gate_weights.chunk(3, 1);
  auto input_gate = torch::sigmoid(gates[0]);
  auto output_gate = torch::sigmoid(gates[1]);
  auto candidate_cell = torch::elu(gates[2], 1.0);
  auto new_cell = old_cell + candidate_cell * input_gate;
  auto new_h = torch::tanh(new_cell) * output_gate;
  return {new_h, new_cell, input_gate, output_gate, candidate_cell, X, gate_weights};
  // ### END SOLUTION
}

std::vector<torch::Tensor> lltm_backward(torch::Tensor grad_h, torch::Tensor grad_cell, torch::Tensor new_cell,
                                         torch::Tensor input_gate, torch::Tensor output_gate,
                                         torch::Tensor candidate_cell, torch::Tensor X, torch::Tensor gate_weights,
                                         torch::Tensor weights) {
  // ### BEGIN SOLUTION
  auto t = torch::tanh(new_cell);
  auto dC = grad_cell + grad_h * output_gate * (1 - t * t);
  auto d_i = dC * candidate_cell * input_gate * (1 - input_gate);
  auto d_o = grad_h * t * output_gate * (1 - output_gate);
  auto z = gate_weights.chunk(3, 1)[2];
  auto d_c = dC * input_gate * torch::where(z > 0, torch::ones_like(candidate_cell), candidate_cell + 1);
  auto d_g = torch::cat({d_i, d_o, d_c}, 1);
  const auto S = grad_h.size(1);
  auto d_old_h = d_g.mm(weights.narrow(1, 0, S));
  auto d_input = d_g.mm(weights.narrow(1, S, weights.size(1) - S));
  return {d_old_h, d_input, d_g.t().mm(X), d_g.sum(0), dC};
  // ### END SOLUTION
}
"""

# %% nbgrader={"grade_id": "cpp_lltm", "grade": true, "points": 4}
_module = sources.build_cpp(LLTM_CPP, name="lab09_lltm")
_ops = lltm.ops_of(_module, "C++")
lltm.check_ops(_ops, lltm.make_inputs(5, 7, 11, dtype=torch.float64, seed=1))
torch.autograd.gradcheck(lambda *t: lltm.lltm_cell(*t, ops=_ops),
                         lltm.make_inputs(2, 3, 4, dtype=torch.float64, seed=2, requires_grad=True))
print("cpp_lltm: visible tests passed (forward, gradients, gradcheck)")
### BEGIN HIDDEN TESTS
lltm.check_ops(_ops, lltm.make_inputs(9, 4, 6, dtype=torch.float64, seed=3))
### END HIDDEN TESTS

# %% [markdown]
# ### Python against C++ (against CUDA)
#
# The same cell through one `autograd.Function` (`lltm.LLTMFunction`), with the Python ops and with
# yours; forward and forward + backward, at the classic tutorial shape (batch 16, 32 inputs, state
# 128). On a GPU the CUDA build (`sources.build_cuda`, a fused kernel for the gate arithmetic)
# joins the table; without one it is only compiled (next cell).

# %%
# Your extension as the test above built it (an unchanged source is loaded again, not rebuilt). The
# grader's quick run of this notebook leaves it out: its graded item builds your source itself.
cpp_ops = None if QUICK else lltm.ops_of(sources.build_cpp(LLTM_CPP, name="lab09_lltm"), "C++")


def cell_pass(ops, backward):
    leaves = [t.clone().requires_grad_(backward) for t in lltm.make_inputs(16, 32, 128, seed=4)]

    def run():
        new_h, new_cell = lltm.lltm_cell(*leaves, ops=ops)
        if backward:
            (new_h.sum() + new_cell.sum()).backward()

    return run


implementations = {"python": lltm.PYTHON_OPS}
if cpp_ops is not None:
    implementations["C++"] = cpp_ops
if device.has_gpu():
    implementations["CUDA"] = lltm.ops_of(sources.build_cuda(name="lab09_lltm_cuda"), "CUDA")
rows = {}
for name, ops in implementations.items():
    for backward in (False, True):
        rows[f"{name} {'forward+backward' if backward else 'forward'}"] = timing.bench(
            cell_pass(ops, backward), warmup=1 if QUICK else 3, reps=3 if QUICK else 30)
timing.table(rows)

# %% [markdown]
# On a CPU, C++ saves only the interpreter's share: each ATen op still runs separately and still
# allocates its result, so expect a modest gain, largest where the tensors are small. The CUDA
# version fuses the elementwise gate math into one kernel, which is where the big gain is on a GPU.
#
# The CUDA source compiles with `nvcc` for Ampere (sm_80) and Hopper (sm_90) on any machine that has
# nvcc, GPU or not; it cannot be linked against this CPU build of PyTorch, so here it is only
# compiled:

# %%
if QUICK:  # what it compiles is the course's source, not yours
    print("nvcc is left out of the grader's quick run of this notebook (about 9 s a compile)")
else:
    try:
        for capability in (80, 90):
            ptx = sources.compile_cuda(capability).decode()
            kernels = [line.split()[-1] for line in ptx.splitlines() if line.startswith(".visible .entry")]
            target = next(line for line in ptx.splitlines() if line.startswith(".target"))
            print(f"{target}: {len(kernels)} kernels, {len(ptx.splitlines())} lines of PTX")
    except RuntimeError as exc:
        print(exc)

# %% [markdown]
# ### A registered op: what `torch.compile` can see
#
# An `autograd.Function` that calls an extension is opaque to `torch.compile`: it cannot trace
# into compiled pybind11 code, so it leaves the call out of the graph (and `fullgraph=True`
# refuses it). Registered with `torch.library`, with a *fake* implementation that only computes
# output shapes and dtypes, the cell becomes an op like `aten::addmm`, and a model that calls it
# compiles as one graph with the op inside:

# %%
from fastdl_lab.custom import library

with library.using_ops(cpp_ops or lltm.PYTHON_OPS):
    step = lambda x, w, b, h, c: library.lltm_op(x, w, b, h, c)
    explained = torch._dynamo.explain(step)(*lltm.make_inputs(4, 6, 8, seed=5))
    print(f"graphs: {explained.graph_count}, graph breaks: {explained.graph_break_count}")
    print("ops in the graph:", [str(n.target) for n in explained.graphs[0].graph.nodes if n.op == "call_function"])

# %% [markdown]
# ## 2. Quantisation: integer codes and a scale
#
# A symmetric int8 quantiser stores $q = \mathrm{clamp}(\mathrm{round}(w/s), -127, 127)$ and one
# scale $s$; $w \approx q s$. With one scale for a whole tensor, $s = \max|w| / 127$ is set by the
# largest weight anywhere: a channel whose weights are all small gets only a few of the 255 codes.
# With one scale **per output channel** (per row of a Linear's weight), every channel uses its full
# range. Measured on the first layer of a small trained MLP (`formats.trained_layer`: its rows' norms
# spread as trained layers' do):

# %%
layer = formats.trained_layer(seed=0)
norms = layer.norm(dim=1)
print(f"{tuple(layer.shape)} weight; row norms from {norms.min():.3f} to {norms.max():.3f}")
for bits in (8, 4):
    tensor_err = formats.quantization_error(layer, bits=bits, axis=None)
    channel_err = formats.quantization_error(layer, bits=bits, axis=0)
    print(f"int{bits}: per tensor {tensor_err['rel_fro']:.2e} ({tensor_err['sqnr_db']:.1f} dB), "
          f"per channel {channel_err['rel_fro']:.2e} ({channel_err['sqnr_db']:.1f} dB)")
formats.plot_channel_errors(layer, bits=4);  # channel by channel: the small ones lose most per tensor

# %% [markdown]
# Write `quantize_per_channel(w)`: symmetric int8, one scale per row, `scale[c] = max|w[c]| / 127`
# as float32 (1.0 for an all-zero row), `q = round(w / scale)` clamped to $[-127, 127]$, as int8.
# Return `(q, scale)`. (Why not −128? A symmetric range keeps $-q$ representable for every code.)
# Write the rounding yourself: torch's own quantizers (`torch.quantize_per_channel`, `torch.ao`'s
# observers, the `fake_quantize_*` ops) are refused in the graded run.

# %% nbgrader={"grade_id": "quant_code", "solution": true}
def quantize_per_channel(w):
    ### BEGIN SOLUTION
    rows = w.detach().float().reshape(w.shape[0], -1)
    top = rows.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    codes = torch.round(rows / scale[:, None]).clamp(-127, 127)
    return codes.to(torch.int8).reshape(w.shape), scale
    ### END SOLUTION


# %% nbgrader={"grade_id": "per_channel_int8", "grade": true, "points": 2}
_w = checks.randn((12, 9), seed=3) * torch.logspace(-2, 1, 12)[:, None]
_w[4] = 0
_q, _scale = quantize_per_channel(_w)
formats.check_per_channel(_q, _scale, _w)
print(f"per_channel_int8: visible tests passed; relative error {((_q.float() * _scale[:, None] - _w).norm() / _w.norm()):.2e}")
### BEGIN HIDDEN TESTS
_w = checks.randn((7, 3, 2), seed=4)
formats.check_per_channel(*quantize_per_channel(_w), _w)
### END HIDDEN TESTS

# %% [markdown]
# ## 3. An int8 matrix multiply in Triton (W8A8)
#
# For inference, weights are quantised once (per channel) and activations on the fly (per row, i.e.
# per token: `formats.quantize_activation`). Then
#
# $$\mathrm{out}[m, n] = \Big(\sum_k a_q[m,k]\, w_q[n,k]\Big)\, s_a[m]\, s_w[n]$$
#
# The scales factor out of the sum: the whole inner loop is integer arithmetic with an **int32
# accumulator** (a product of two int8 codes needs 15 bits; thousands of them need 32), which is what
# int8 tensor cores do at twice the fp16 rate. Dequantise once per output, in the epilogue.
#
# Write `int8_matmul_kernel`. Program `(pid_m, pid_n)` computes one `BLOCK_M × BLOCK_N` tile; `w` is
# stored as `N × K` (a Linear's layout), so load its tile as `K × N`. Use
# `tl.dot(a, w, acc, out_dtype=tl.int32)` with `acc` an int32 zero tile, mask the ragged edges (codes
# past an edge load as 0 and add nothing), then `acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]`
# in exactly that order, so the result equals the reference bit for bit. The launcher
# `w8a8.int8_matmul(a_q, a_scale, w_q, w_scale, kernel=...)` validates and launches it.

# %% nbgrader={"grade_id": "kernel_code", "solution": true}
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def int8_matmul_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, c_ptr, M, N, K,
                       stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ### BEGIN SOLUTION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    w_tile = w_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=(rows[:, None] < M) & (ks[None, :] + start < K), other=0)
        w = tl.load(w_tile, mask=(ks[:, None] + start < K) & (cols[None, :] < N), other=0)
        total = tl.dot(a, w, total, out_dtype=tl.int32)
        a_tile += BLOCK_K * stride_ak
        w_tile += BLOCK_K * stride_wk
    sa = tl.load(a_scale_ptr + rows, mask=rows < M, other=0.0)
    sw = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    result = total.to(tl.float32) * sa[:, None] * sw[None, :]
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn, result,
             mask=(rows[:, None] < M) & (cols[None, :] < N))
    ### END SOLUTION


# %% nbgrader={"grade_id": "int8_matmul", "grade": true, "points": 4}
def _check_int8(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    sa, sw = torch.rand(m, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.1
    got = w8a8.int8_matmul(a.to(DEVICE), sa.to(DEVICE), w.to(DEVICE), sw.to(DEVICE), kernel=int8_matmul_kernel)
    w8a8.check_int8_matmul(got, a, sa, w, sw, name=f"{m}x{n}x{k}")


_check_int8(64, 64, 64, 0)
_check_int8(37, 70, 130, 1)
print("int8_matmul: visible tests passed (bit-exact)")
### BEGIN HIDDEN TESTS
_check_int8(5, 3, 2000, 2)
### END HIDDEN TESTS

# %% [markdown]
# Why bit-exact is possible: an int32 sum is the same whatever order the tiles add in, and the
# epilogue's two products are done in one order everywhere. A float16 accumulator would not be
# exact past 2048, and even float32 stops being exact past $2^{24}$: a 4096-deep sum of products of
# 127s reaches $6.6 \cdot 10^7$.
#
# On a GPU the kernel runs on the integer tensor cores. Without one, its PTX shows the instruction
# it compiles to:

# %%
if QUICK:  # two compiles to PTX, seconds per graded run, and the grade needs neither
    print("the PTX of your kernel is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    for capability in (80, 90):
        text = w8a8.ptx(capability, kernel=int8_matmul_kernel)
        found = sorted({line.split()[0] for line in text.splitlines() if "mma" in line and "s8" in line})
        print(f"sm_{capability}: {found[:3]}")

# %% [markdown]
# A whole layer: `w8a8.W8A8Linear` replaces an `nn.Linear` with per-channel int8 weights and
# per-row dynamic activation scales. Its output against the float layer's:

# %%
float_layer = nn.Linear(32, 128)
trained = formats.trained_layer(seed=1)
with torch.no_grad():
    float_layer.weight.copy_(trained)
int8_layer = w8a8.W8A8Linear(float_layer, kernel=int8_matmul_kernel)
x = torch.randn(40, 32)
with torch.no_grad():
    error = (int8_layer(x.to(DEVICE)).cpu() - float_layer(x)).norm() / float_layer(x).norm()
print(f"W8A8 against fp32: relative error {error:.2e}, weights {float_layer.weight.numel()} bytes instead of "
      f"{float_layer.weight.numel() * 4}")

# %% [markdown]
# ### Context: TPUs are int8 machines too
#
# Google's first TPU (v1, 2015) was an inference co-processor built around this arithmetic: a
# 256 × 256 systolic array of 8-bit multiply-accumulate units with 32-bit accumulators, weights
# streamed in once and activations flowing through. Training needs more range than int8 gives, so
# TPU v2 added floating point: bf16 multiplies with fp32 accumulation — the same split of "narrow
# inputs, wide accumulator" that you just wrote in Triton.
#
# ## 4. Quantisation-aware training
#
# At 4-bit weights, post-training quantisation (PTQ: round a trained model's weights and hope)
# moves the decision boundaries of a small classifier enough to lose a large share of its accuracy.
# Quantisation-aware training (QAT) fine-tunes *with the rounding in the forward pass*, so the
# weights settle where the rounded network is good. Rounding has zero gradient almost everywhere;
# the **straight-through estimator** (STE) passes the incoming gradient through as if rounding were
# the identity — except where the value was clamped, where moving it changes nothing.
#
# Write `fake_quant(x, scale, zero_point=0, bits=8)`: forward $(\mathrm{clamp}(\mathrm{round}(x/s) + z, q_{min}, q_{max}) - z)\,s$
# with $[q_{min}, q_{max}] = [-2^{b-1}+1, 2^{b-1}-1]$ (symmetric), backward by the STE. A
# `torch.autograd.Function` subclass with `forward` and `backward` static methods is the usual way.
# The grader trains the lab's model with your function on training points drawn from a hidden
# seed, and evaluates it on test points it keeps to itself, with the course's own rounding: QAT
# must beat PTQ by at least 10 points. (torch's `fake_quantize_*` ops, whose backward is already
# the STE, are refused in the graded run.)

# %% nbgrader={"grade_id": "qat_code", "solution": true}
class RoundWithSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, lowest, highest):
        ### BEGIN SOLUTION
        grid = torch.round(x / scale) + zero_point
        ctx.save_for_backward((grid >= lowest) & (grid <= highest))
        return (grid.clamp(lowest, highest) - zero_point) * scale
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        ### BEGIN SOLUTION
        (kept,) = ctx.saved_tensors
        return grad_out * kept, None, None, None, None
        ### END SOLUTION


def fake_quant(x, scale, zero_point=0, bits=8):
    ### BEGIN SOLUTION
    top = 2 ** (bits - 1) - 1
    return RoundWithSTE.apply(x, scale, zero_point, -top, top)
    ### END SOLUTION


# %% nbgrader={"grade_id": "qat_beats_ptq", "grade": true, "points": 3}
_x = torch.linspace(-1, 1, 11, requires_grad=True)
_y = fake_quant(_x, torch.tensor(0.25), bits=3)
torch.testing.assert_close(_y.detach(), training.round_to_grid(_x.detach(), torch.tensor(0.25), bits=3))
_y.sum().backward()
assert _x.grad is not None and _x.grad.abs().sum() > 0, "no gradient reaches x: the rounding needs the STE"
_result = training.experiment(0, steps=150, fake_quant=fake_quant)
print(f"seed 0, 150 QAT steps: float {_result['float']:.1%}, PTQ {_result['ptq']:.1%}, QAT {_result['qat']:.1%}")
assert _result["qat"] > _result["ptq"], "QAT should beat PTQ"
print("qat_beats_ptq: visible tests passed")
### BEGIN HIDDEN TESTS
torch.testing.assert_close(fake_quant(torch.tensor([3.0, -3.0]), torch.tensor(1.0), bits=2), torch.tensor([1.0, -1.0]))
### END HIDDEN TESTS

# %% [markdown]
# What the rounding does to the classifier, drawn: each model's class regions over the plane, the
# test points on top. PTQ's coarse weights move the boundaries between the spiral arms; QAT's
# training puts them back where the rounded network can hold them.

# %%
if QUICK:  # two more trainings per graded run, for a picture
    print("the decision-boundary plot is left out of the grader's quick run of this notebook (FASTDL_QUICK=1)")
else:
    training.plot_decision_maps(training.decision_maps(0));

# %% [markdown]
# ## 5. Inference-time fusion
#
# At inference, BatchNorm is an affine map with frozen statistics: fold it into the Linear (or
# convolution) before it, as lab 02 did for Conv+BN, and it costs nothing. `torch.compile` then
# fuses the elementwise work that remains, though by default not into the matmuls: Inductor calls
# each matmul as an external library kernel and fuses the elementwise ops after it into a
# separate generated kernel. Fusing them into the matmul's epilogue needs template GEMMs, which
# Inductor generates itself only under `mode="max-autotune"`, and keeps only where autotuning
# finds a template faster than the library call.

# %%
model = fusion.bn_mlp(seed=0).eval()
x = torch.randn(512, model[0].in_features)
try:
    folded = fusion.fold_linear_bn_model(model)
except NotImplementedError:
    # The student copy of the package leaves lab 02's fold to lab 02: bring yours.
    folded = None
    print("paste your fold_conv_bn from lab 02 into a cell and call fusion.fold_linear_bn_model(model, fold=fold_conv_bn)")
if folded is not None:
    with torch.inference_mode():
        print("max difference folded vs original:", float((folded(x) - model(x)).abs().max()))
        print(f"ops per forward: {fusion.forward_ops(model, x)} -> {fusion.forward_ops(folded, x)}")
        print(timing.compare(lambda: folded(x), lambda: model(x), warmup=1 if QUICK else 2, reps=3 if QUICK else 20))

# %% [markdown]
# `torch.compile(model)` called under `torch.inference_mode()` compiles a graph with no autograd
# state in it; the first call compiles (tens of seconds on a CPU), later calls run the generated
# code. The benchmark (`benchmarks/quant.py`) records eager, folded and compiled side by side.
#
# ## 6. A smaller model: distillation
#
# Quantisation and fusion make a given model cheaper. For a single request, the other lever is a
# model that does less work in the first place, and a small model trained on labels alone is
# usually worse than a large one. **Distillation** trains the small model (the *student*) on what
# a large trained model (the *teacher*) outputs. Softened by a temperature $T$, the teacher's
# distribution ranks the wrong classes too (this 4 looks a little like a 9, not at all like a 0),
# which is more information per example than a one-hot label. The loss
# (`distill.distillation_loss_ref`) is
#
# $$T^2 \,\mathrm{KL}\big(\mathrm{softmax}(z_t / T)\,\big\|\,\mathrm{softmax}(z_s / T)\big),$$
#
# where the $T^2$ keeps the gradients the size of a cross-entropy's as $T$ grows; it can be mixed
# with the cross-entropy on the labels. The experiment: scikit-learn's handwritten digits (8 × 8
# scans), a teacher MLP trained on 1200 labelled digits (64 → 128 → 128 → 10; a one-layer 64 → 64
# → 10 in the grader's quick run), then one student (64 → 16 → 10) trained twice from the same
# initialisation on the same 100 examples for the same steps, once on their hard labels and once
# on the teacher's soft targets at $T = 4$.

# %%
from fastdl_lab import distill

seeds = [0] if QUICK else [0, 1, 2, 3, 4]
# The grader's run: a one-layer teacher and fewer steps (0.3 s instead of 1-2 s per seed).
smaller = dict(teacher_sizes=(64, 64, 10), teacher_steps=80, student_steps=100) if QUICK else {}
for seed in seeds:
    kd = distill.experiment(seed, **smaller)
    print(f"seed {seed}: teacher {kd['teacher']:.1%} ({kd['params']['teacher']:,} parameters); student "
          f"({kd['params']['student']:,}): hard labels {kd['hard labels']:.1%}, distilled {kd['distilled']:.1%}")

# %% [markdown]
# What it buys at serving time, on this machine: one request (one digit) through the teacher and
# through the student, timed A/B.

# %%
one = distill.digits_split(0)[2][:1]
with torch.inference_mode():
    print(timing.compare(lambda: kd["models"]["distilled"](one), lambda: kd["models"]["teacher"](one),
                         warmup=2, reps=3 if QUICK else 50))

# %% [markdown]
# The student has 4 to 21 times fewer multiply-adds than the teacher (the parameter counts above),
# but one request through either is a few tiny matmuls, so the time goes to per-op overhead (lab
# 02's flat curve), and the ratio is closer to the ratio of *layers* than of FLOPs. For a model large enough to be compute- or
# bandwidth-bound, the parameter ratio is what a request saves. Distillation is not free
# accuracy: trained on all 1200 labelled digits instead of 100 (`transfer=1200`), the distilled
# student ended level with the hard-label one or up to 1.2 points behind it (seeds 0-4, measured
# on the 2-core course machine). It pays where the student's labelled data are few and the
# teacher's knowledge fills in.
#
# ### Serving one request: cheaper layers, and engines built for one GPU
#
# Distillation shrinks a model you already have. The other route is an architecture built to be
# cheap per request. MobileNet (Howard et al., 2017) replaces each $k \times k$ convolution from
# $C_{in}$ to $C_{out}$ channels ($C_{in} C_{out} k^2$ multiply-adds per output pixel) with a
# **depthwise** $k \times k$ convolution that filters each channel on its own (`groups=C_in`:
# $C_{in} k^2$) followed by a **pointwise** $1 \times 1$ convolution that mixes the channels
# ($C_{in} C_{out}$). The multiply-adds fall to a fraction $1/C_{out} + 1/k^2$ of the original,
# about a ninth for $3 \times 3$ filters. `separable.conv_flops` and `separable.separable_flops`
# are the formulas (checked against PyTorch's `FlopCounterMode` in the tests); below, one image
# through both layers in one thread, as a server handling requests side by side runs them:

# %%
from fastdl_lab import separable

channels, size = (32, 28) if QUICK else (128, 56)
sep = separable.batch1_comparison(channels, channels, size, reps=3 if QUICK else 20)
print(f"{channels} -> {channels} channels, {size} x {size}, 3 x 3: separable/standard FLOPs "
      f"{sep['flop_ratio']:.3f}, time {sep['time_ratio']:.3f} ({sep['timing']})")
print(f"the depthwise half: {sep['depthwise_share']['flops']:.1%} of the separable block's FLOPs, "
      f"{sep['depthwise_share']['time']:.1%} of its time")

# %% [markdown]
# The time falls by much less than the FLOPs. On the 2-core course machine (128 channels, 56 × 56,
# one thread; `benchmarks/results/experiments.csv`) the separable layer had 0.119 of the FLOPs and
# took 0.22 of the time, and its depthwise half did 6.6% of its FLOPs in 45% of its time (0.33
# and 58% in a run beside other work: the depthwise half suffers most from a busy memory system). A depthwise convolution
# does only $k^2 = 9$ multiply-adds per value it reads, so it sits far left on lab 00's roofline,
# bound by memory; the pointwise half is a plain matrix multiply. FLOPs are the wrong currency
# for such layers: count bytes too, and measure.
#
# **Inference engines.** NVIDIA's TensorRT takes a trained model (through ONNX, or
# Torch-TensorRT from PyTorch) and builds an *engine* for one GPU: it fuses layers (convolution,
# bias and activation in one kernel, as section 5 did by hand), times the candidate kernels for
# each layer on that very GPU and keeps the fastest ("tactics"), and runs in fp16, int8 or fp8
# where calibration data show the accuracy holds (section 2's scales). The engine is tied to the
# GPU model and the TensorRT version it was built with, which is why a serving fleet rebuilds
# engines per GPU type. It needs an NVIDIA GPU and is not installed by this course: nothing here
# runs it. `torch.compile(mode="max-autotune")` is the same idea inside PyTorch: it benchmarks
# candidate kernels on the machine it runs on.
#
# ## 7. Skipping zeros: sparse products
#
# Pruning sets most of a layer's weights to zero; the product can then skip them. Stored as
# **CSR** (the nonzeros, their column indices, where each row starts), a sparse-times-dense
# product does work in proportion to the nonzeros, but each nonzero costs an index read and an
# irregular gather of a row of the dense operand, while the dense product streams regular,
# cache-blocked tiles through vector units (or tensor cores). `sparse.density_sweep` times
# `torch.sparse.mm` on CSR against the dense product as the density falls, on one thread:

# %%
from fastdl_lab import sparse

sweep = sparse.density_sweep(256 if QUICK else 1024, densities=(0.01, 0.1, 0.5) if QUICK else
                             (0.001, 0.01, 0.05, 0.1, 0.3), reps=3 if QUICK else 10)
for r in sweep:
    print(f"density {r['density']:5.1%}: {r['nnz']:7d} nonzeros, sparse {r['sparse_s'] * 1e3:7.3f} ms, "
          f"dense {r['dense_s'] * 1e3:7.3f} ms: sparse {r['speedup']:.2f}x")
pruned = sparse.prune_2_4(checks.randn(128, 128, seed=3))  # the GPU format wants both sides multiples of 64
print(f"2:4 pruned: {sparse.is_2_4(pruned)}, {int((pruned != 0).sum())} of {pruned.numel()} kept")
try:
    sparse.semi_structured(pruned.half().to("cuda" if device.has_gpu() else "cpu"))
    print("2:4 semi-structured format built on this GPU")
except RuntimeError as exc:  # without a GPU it says so; an older GPU says what it lacks
    print(exc)

# %% [markdown]
# On the 2-core course machine (1024 × 1024, one thread; `benchmarks/results/experiments.csv`)
# sparse won only below about 10% nonzeros: 5.3× faster at 1%, 1.9× at 5%, even at 10%, three
# times slower at 30%. A GPU makes the
# crossover lower still for unstructured sparsity: its dense products run on tensor cores, and
# irregular gathers waste the wide memory transactions it is built for. What pays on a GPU is
# sparsity with a regular pattern. **2:4** (Ampere and later): in every group of four weights of a
# row at most two are nonzero (`sparse.prune_2_4` keeps the two largest); the tensor cores store
# the two values with 2-bit positions and multiply at up to twice the dense rate, through
# `torch.sparse.to_sparse_semi_structured`. A 2:4-pruned model is usually fine-tuned to win back
# its accuracy. **Block sparsity** (whole tiles zero) lets a tiled kernel like yours skip tiles.
#
# ## GPU speed item
#
# On GPU profiles the grader times your int8 kernel against the float16 matmul it replaces, A/B in
# one process.

# %% nbgrader={"grade_id": "int8_matmul_speed", "grade": true, "points": 2}
if device.has_gpu():
    print("int8_matmul_speed: graded by the course's grader on a GPU profile")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## Summary
#
# - A C++ extension removes the interpreter between ops; a CUDA kernel removes the ops themselves
#   (one fused launch). Check every hand-written backward against autograd (`gradcheck`).
# - Register custom ops with `torch.library` and a fake implementation so compilers can trace them.
# - int8 weights with one scale per output channel keep small channels precise; activations get a
#   scale per token at run time.
# - An int8 matmul accumulates in int32 and dequantises once per output: exact, and twice the fp16
#   tensor-core rate.
# - When post-training rounding costs too much accuracy, train with the rounding in the loop (QAT,
#   straight-through estimator).
# - A smaller model serves a request with less work; distillation trains it on the teacher's
#   softened outputs, which carry more per example than labels.
# - Unstructured sparsity pays only at low density, and less on a GPU than on a CPU; 2:4 and
#   block sparsity keep the regular access hardware needs.
