"""Graded items of lab 02 fusion: fused softmax, its memory traffic, Conv+BN folding, ConvBN memory."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs import _common
from autograder.labs._common import on_device, per_case, require_tensor, triton_kernel
from fastdl_lab import checks

# Bound before any student cell runs (see lab01_gemm): the hint ConvBN's reason may carry.
from fastdl_lab.memory import _saved_storages
from fastdl_lab.softmax import check_softmax
from fastdl_lab.softmax import softmax as _launch


# --- fused softmax ---------------------------------------------------------------------------

def _softmax_inputs(dtype):
    def make(seed: int, params: dict) -> dict:
        gen = torch.Generator().manual_seed(seed % (1 << 63))
        xs, blocks = [], []
        for rows, cols, block_n in params["shapes"]:
            x = torch.randn(rows, cols, generator=gen) * 3
            # One row far from zero (exp overflows unless the max is subtracted first) and a few
            # -inf entries (masked positions, as in attention), never a whole row of them.
            x[0] += 1e4
            if rows > 1:
                cols_inf = torch.randperm(cols, generator=gen)[: max(1, cols // 5)]
                x[rows // 2, cols_inf] = float("-inf")
                x[rows // 2, (cols_inf[0] + 1) % cols] = 0.0
            xs.append(x.to(dtype))
            blocks.append(block_n)
        return {"x": xs, "block_n": blocks}
    return make


def softmax_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, "softmax_kernel")
    return [_launch(on_device(x), kernel=kernel, block_n=bn).cpu() for x, bn in zip(inputs["x"], inputs["block_n"])]


def softmax_check(inputs: dict, outputs, params: dict) -> Verdict:
    xs = inputs["x"]
    if not isinstance(outputs, list) or len(outputs) != len(xs):
        return Verdict.failed(f"expected {len(xs)} results, got {type(outputs).__name__}")
    labels = [f"{tuple(x.shape)} block_n={bn}" for x, bn in zip(xs, inputs["block_n"])]

    def check_one(i: int) -> None:
        require_tensor(outputs[i], f"softmax of {labels[i]}")
        check_softmax(outputs[i], xs[i], name=f"softmax of {labels[i]}")

    return per_case(labels, check_one)


# --- bytes moved -----------------------------------------------------------------------------

def bytes_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    return {"cases": [(rng.randint(1, 50_000), rng.randint(1, 50_000), rng.choice([1, 2, 4, 8]))
                      for _ in range(int(params.get("cases", 12)))]}


def bytes_drive(ns: dict, inputs: dict) -> list:
    return [[int(v) for v in ns["softmax_bytes"](m, n, b)] for m, n, b in inputs["cases"]]


def bytes_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.softmax import softmax_bytes_ref

    for (m, n, b), got in zip(inputs["cases"], outputs, strict=True):
        expected = [int(v) for v in softmax_bytes_ref(m, n, b)]
        if list(got) != expected:
            return Verdict.failed(
                f"softmax_bytes({m}, {n}, {b}) gave (naive, fused) = {tuple(got)}, expected {tuple(expected)}")
    m, n, b = inputs["cases"][0]
    naive, fused = softmax_bytes_ref(m, n, b)
    return Verdict.passed(f"correct on {len(inputs['cases'])} hidden sizes; e.g. fusion moves {naive / fused:.2f}x fewer bytes")


# --- Conv+BN folding -------------------------------------------------------------------------

def fold_inputs(seed: int, params: dict) -> dict:
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    layers = []
    for cin, cout, k, stride, padding, bias in params["convs"]:
        layers.append({
            "config": [cin, cout, k, stride, padding, int(bias)],
            "weight": torch.randn(cout, cin, k, k, generator=gen) * 0.3,
            "bias": torch.randn(cout, generator=gen) if bias else torch.zeros(0),
            "gamma": torch.rand(cout, generator=gen) + 0.5,
            "beta": torch.randn(cout, generator=gen),
            "mean": torch.randn(cout, generator=gen),
            "var": torch.rand(cout, generator=gen) * 2 + 0.05,
            "eps": torch.tensor(10 ** -torch.randint(3, 6, (1,), generator=gen).item()),
            "x": torch.randn(2, cin, 11, 13, generator=gen),
        })
    return {"layers": layers}


def fold_drive(ns: dict, inputs: dict) -> list:
    results = []
    for layer in inputs["layers"]:
        cin, cout, k, stride, padding, bias = layer["config"]
        conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=padding, bias=bool(bias))
        bn = torch.nn.BatchNorm2d(cout, eps=float(layer["eps"]))
        with torch.no_grad():
            conv.weight.copy_(layer["weight"])
            if bias:
                conv.bias.copy_(layer["bias"])
            bn.weight.copy_(layer["gamma"])
            bn.bias.copy_(layer["beta"])
            bn.running_mean.copy_(layer["mean"])
            bn.running_var.copy_(layer["var"])
        conv.eval()
        bn.eval()
        folded = ns["fold_conv_bn"](conv, bn)
        bias_out = folded.bias.detach().clone() if folded.bias is not None else torch.zeros(0)
        results.append({"weight": folded.weight.detach().clone(), "bias": bias_out,
                        "stride": list(folded.stride), "padding": list(folded.padding)})
    return results


def fold_check(inputs: dict, outputs, params: dict) -> Verdict:
    layers = inputs["layers"]
    labels = []
    for layer in layers:
        cin, cout, k, stride, padding, bias = layer["config"]
        labels.append(f"conv {cin}->{cout} k={k} stride={stride} pad={padding} {'with' if bias else 'without'} bias")

    def check_one(i: int) -> None:
        layer, out = layers[i], outputs[i]
        _, cout, _, stride, padding, bias = layer["config"]
        x = layer["x"].double()
        y = F.conv2d(x, layer["weight"].double(), layer["bias"].double() if bias else None, stride=stride, padding=padding)
        reference = F.batch_norm(y, layer["mean"].double(), layer["var"].double(), layer["gamma"].double(),
                                 layer["beta"].double(), training=False, eps=float(layer["eps"]))
        if out["bias"].numel() != cout:
            raise AssertionError(f"{labels[i]}: the folded conv needs a bias of {cout} values")
        # The parent applies the returned weights itself: the student's forward is not trusted.
        folded = F.conv2d(x.float(), out["weight"], out["bias"], stride=tuple(out["stride"]), padding=tuple(out["padding"]))
        checks.assert_close(folded, reference.float(), name=f"folded {labels[i]}", atol=1e-4, rtol=1e-4)

    return per_case(labels, check_one)


# --- ConvBN with recompute -------------------------------------------------------------------
#
# One Conv -> BN pair does not show recomputation in a memory peak: the forward holds x, the
# conv's output y and the output at once whether or not y is kept, and the backward that
# recomputes y holds it again. What recomputation buys is what waits for the backward: in a chain
# of layers, Conv -> BN keeps every layer's y until the backward reaches it, recomputation none.
# So the memory case is a chain of ``layers`` 1x1 Conv -> BN pairs, each y of a few MiB: at the end
# of the forward the two differ by every y of the chain (hundreds of MiB), while what one layer
# adds or saves for a moment is a few y. Small layers keep that moment small next to the chain.


def _convbn_case(gen: torch.Generator, n: int, cin: int, cout: int, h: int, w: int, k: int) -> dict:
    return {"x": torch.randn(n, cin, h, w, generator=gen),
            "conv_weight": torch.randn(cout, cin, k, k, generator=gen) * (k * k * cin) ** -0.5,
            "bn_weight": torch.rand(cout, generator=gen) + 0.5,
            "bn_bias": torch.randn(cout, generator=gen)}


def convbn_inputs(seed: int, params: dict) -> dict:
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    cases = []
    for n, cin, cout, h, w, k, stride, padding, eps in params["cases"]:
        case = _convbn_case(gen, n, cin, cout, h, w, k)
        out_h, out_w = ((size + 2 * padding - k) // stride + 1 for size in (h, w))
        case.update(config=[int(stride), int(padding)], eps=torch.tensor(float(eps)),
                    grad=torch.randn(n, cout, out_h, out_w, generator=gen))
        cases.append(case)
    layers, n, c, size = params["chain"]
    # Near-identity channel mixing and gammas near 1 keep a deep chain well conditioned: fp32
    # rounding then stays near 1e-5 of each result's scale, far below what a mistake changes.
    mixing = torch.eye(c) + 0.3 * c ** -0.5 * torch.randn(layers, c, c, generator=gen)
    chain = {"x": torch.randn(n, c, size, size, generator=gen), "conv_weight": mixing.view(layers, c, c, 1, 1),
             "bn_weight": torch.rand(layers, c, generator=gen) * 0.4 + 0.8,
             "bn_bias": torch.randn(layers, c, generator=gen), "grad": torch.randn(n, c, size, size, generator=gen)}
    return {"cases": cases, "chain": chain}


PARTS = ("x", "conv_weight", "bn_weight", "bn_bias")
GRAD_NAMES = ("dx", "d conv_weight", "d bn_weight", "d bn_bias")


def _leaves(case: dict) -> list[torch.Tensor]:
    return [case[k].clone().requires_grad_() for k in PARTS]


def run_chain(fn, x, conv_weight, bn_weight, bn_bias, eps: float = 1e-5) -> torch.Tensor:
    """``fn`` (a ConvBN) layer after layer: 1x1 convolutions, stride 1, no padding."""
    for i in range(conv_weight.shape[0]):
        x = fn(x, conv_weight[i], bn_weight[i], bn_bias[i], eps, 1, 0)
    return x


def convbn_drive(ns: dict, inputs: dict) -> dict:
    """Small cases (3x3, strides, padding), then the chain: one forward and backward, whose outputs and
    gradients the parent checks and whose memory the cgroup measures. The saved bytes are counted
    on that same call, in this process: a hint for the reason, never a score."""
    _common.exact_peaks()
    fn = ns["conv_bn_train"]
    cases = []
    for case in inputs["cases"]:
        leaves = _leaves(case)
        stride, padding = case["config"]
        y = fn(*leaves, float(case["eps"]), stride, padding)
        # A scalar loss: grad_outputs would have autograd import sympy in this fresh process.
        grads = torch.autograd.grad((y * case["grad"]).sum(), leaves, allow_unused=True)
        cases.append({"y": y.detach(), "grads": list(grads)})
    chain = inputs["chain"]
    leaves = _leaves(chain)
    out, saved = _saved_storages(lambda *t: run_chain(fn, *t), leaves)
    grads = torch.autograd.grad((out * chain["grad"]).sum(), leaves, allow_unused=True)
    return {"cases": cases, "chain": {"y": out.detach(), "grads": list(grads)},
            "saved_bytes": int(sum(saved.values()))}


def _convbn_reference(case: dict, stride: int, padding: int, eps: float):
    from fastdl_lab.fusion import conv_bn_train_ref

    leaves = [case[k].double().requires_grad_() for k in PARTS]
    y = conv_bn_train_ref(*leaves, eps, stride, padding)
    return y.detach(), torch.autograd.grad((y * case["grad"].double()).sum(), leaves)


def _compare(got: dict, want, label: str, scaled: bool) -> None:
    """``got`` = {"y", "grads"} against the float64 reference. ``scaled``: within 1e-4 of each
    result's largest magnitude (a chain's gradients sum hundreds of thousands of terms, and its
    rounding grows with their size), else the fixed tolerances of the single layer."""
    if not isinstance(got, dict) or not isinstance(got.get("grads"), list) or len(got["grads"]) != 4:
        raise AssertionError(f"{label}: expected an output and four gradients")
    y, grads = want
    for name, value, exact in zip(("output", *GRAD_NAMES), (got["y"], *got["grads"]), (y, *grads)):
        if value is None:
            raise AssertionError(f"{label}: {name} is missing: is the autograd.Function's backward wired?")
        require_tensor(value, f"{label}: {name}")
        if scaled:
            atol, rtol = 1e-4 * float(exact.abs().max()), 1e-4
        else:
            atol, rtol = (1e-4, 1e-4) if name == "output" else (1e-3, 1e-3)
        checks.assert_close(value, exact.float(), name=f"{label}: {name}", atol=atol, rtol=rtol)


def convbn_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    from fastdl_lab.fusion import conv_bn_train_ref

    if not isinstance(outputs, dict) or not isinstance(outputs.get("cases"), list):
        return Verdict.failed(f"expected results by name, got {type(outputs).__name__}")
    chain = inputs["chain"]
    layers, n, c, size = params["chain"]
    label = f"chain of {layers} ConvBN layers ({n}x{c}x{size}x{size})"
    try:
        for i, (case, got) in enumerate(zip(inputs["cases"], outputs["cases"], strict=True)):
            stride, padding = case["config"]
            _compare(got, _convbn_reference(case, stride, padding, float(case["eps"])),
                     f"case {i} (stride {stride}, padding {padding})", scaled=False)
        leaves = [chain[k].double().requires_grad_() for k in PARTS]
        y = run_chain(conv_bn_train_ref, *leaves)
        want = y.detach(), torch.autograd.grad((y * chain["grad"].double()).sum(), leaves)
        _compare(outputs["chain"], want, label, scaled=True)
    except (AssertionError, ValueError) as exc:
        return Verdict.failed(_common.failure_text(exc) if isinstance(exc, AssertionError) else str(exc)[:600])
    # What Conv -> BN would keep beyond recomputation at the end of the chain's forward: every y.
    conv_outputs = layers * chain["x"].numel() * 4
    kept, memory, figures = _common.peak_verdict(
        observed, params, f"on a chain of {layers} layers", f"keeping every conv output costs "
        f"{_common.mib(conv_outputs)}")
    figures = {**figures, "conv_outputs_bytes": conv_outputs, "saved_bytes_self_reported": outputs.get("saved_bytes")}
    if kept:
        return Verdict(1.0, f"outputs and gradients correct; {memory}", figures)
    hint = outputs.get("saved_bytes")
    hint = f"; your process counted {_common.mib(hint)} saved (self-reported, not scored)" \
        if isinstance(hint, int) else ""
    return Verdict(1 / 3, f"outputs and gradients correct, but {memory}: recompute the convolution in "
                          f"backward{hint}", figures)


def convbn_reference(inputs: dict) -> dict:
    """The course's ConvBN with recompute, under the names the drive finds the student's."""
    from fastdl_lab import fusion

    return {"conv_bn_train": fusion.conv_bn_train, "ConvBNRecompute": fusion.ConvBNFunction}


# --- speed (GPU profiles) --------------------------------------------------------------------

def speed_inputs(seed: int, params: dict) -> dict:
    rows, cols = params.get("shape", [4096, 4096])
    return {"x": [checks.randn(rows, cols, dtype=torch.float16, seed=seed % (1 << 31))], "block_n": [None]}


def speed_timed(ns: dict, inputs: dict):
    kernel = triton_kernel(ns, "softmax_kernel")
    x = on_device(inputs["x"][0])
    return lambda: [_launch(x, kernel=kernel)]


def speed_baseline(_ns: dict, inputs: dict):
    x = on_device(inputs["x"][0])
    return lambda: [torch.softmax(x, dim=-1)]


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return softmax_check(inputs, [o.cpu() for o in outputs], params)


MEMORY_INSTRUMENTS = ("autograder.labs.lab02_fusion._saved_storages", *_common.SAVED_TENSOR_INSTRUMENTS)
# ConvBN's memory is the cgroup's peak of its child, on the host even on a GPU profile; only the
# screened class and function run there (engine/artefacts.py), and the course's ConvBN runs the same
# driver in a reference child for the peak to be compared with.
CONVBN_SCOPE = "import torch\nimport torch.nn.functional as F\n"

LAB = LabSpec(
    name="02_fusion",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("softmax_fp32", 3, ("softmax_kernel_code",), _softmax_inputs(torch.float32), softmax_drive, softmax_check,
             kernels=("softmax_kernel",), description="fused softmax, fp32, rows longer than a block, large and -inf values"),
        Item("softmax_fp16", 2, ("softmax_kernel_code",), _softmax_inputs(torch.float16), softmax_drive, softmax_check,
             kernels=("softmax_kernel",), description="fused softmax, fp16 (low-precision rule)"),
        Item("softmax_bytes", 2, ("softmax_bytes_code",), bytes_inputs, bytes_drive, bytes_check,
             kind="mechanism", description="bytes moved by eager vs fused softmax"),
        Item("conv_bn_fold", 3, ("fold_code",), fold_inputs, fold_drive, fold_check,
             description="Conv+BatchNorm folding on a hidden network"),
        Item("convbn_memory", 3, ("convbn_code",), convbn_inputs, convbn_drive, convbn_check,
             kind="mechanism", instruments=MEMORY_INSTRUMENTS, artefacts=("ConvBNRecompute", "conv_bn_train"),
             scope=CONVBN_SCOPE, reference=convbn_reference, reference_run=True, host_only=True,
             description="ConvBN recompute: correct, and a chain's memory peak near the course's recompute"),
        Item("softmax_speed", 2, ("softmax_kernel_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=("softmax_kernel",),
             description="speed vs torch.softmax (GPU profiles)"),
    ],
)
