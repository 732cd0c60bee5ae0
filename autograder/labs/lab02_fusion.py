"""Graded items of lab 02 fusion: fused softmax, its memory traffic, Conv+BN folding, ConvBN memory."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs import _common
from autograder.labs._common import on_device, per_case, require_tensor, triton_kernel
from fastdl_lab import checks

# Bound before any student cell runs (see lab01_gemm).
from fastdl_lab.memory import saved_tensor_bytes as _saved_tensor_bytes
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

def convbn_inputs(seed: int, params: dict) -> dict:
    gen = torch.Generator().manual_seed(seed % (1 << 63))
    n, cin, cout, h, w = params["shape"]
    return {
        "x": torch.randn(n, cin, h, w, generator=gen),
        "conv_weight": torch.randn(cout, cin, 3, 3, generator=gen) * 0.2,
        "bn_weight": torch.rand(cout, generator=gen) + 0.5,
        "bn_bias": torch.randn(cout, generator=gen),
        "grad": torch.randn(n, cout, h, w, generator=gen),
    }


def _args(inputs: dict) -> list[torch.Tensor]:
    return [inputs[k].clone().requires_grad_() for k in ("x", "conv_weight", "bn_weight", "bn_bias")]


def convbn_drive(ns: dict, inputs: dict) -> dict:
    fn = ns["conv_bn_train"]
    args = _args(inputs)
    saved = _saved_tensor_bytes(fn, *args)
    args = _args(inputs)
    y = fn(*args)
    y.backward(inputs["grad"])
    return {"y": y.detach(), "grads": [a.grad for a in args], "saved_bytes": int(saved)}


def convbn_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.fusion import conv_bn_train_ref
    from fastdl_lab.memory import saved_tensor_bytes

    args = _args(inputs)
    reference_bytes = saved_tensor_bytes(conv_bn_train_ref, *_args(inputs))
    y = conv_bn_train_ref(*args)
    y.backward(inputs["grad"])
    try:
        checks.assert_close(outputs["y"], y.detach(), name="ConvBN output", atol=1e-4, rtol=1e-4)
        for name, got, arg in zip(("dx", "d conv_weight", "d bn_weight", "d bn_bias"), outputs["grads"], args):
            if got is None:
                raise AssertionError(f"{name} is missing: is the autograd.Function's backward wired?")
            checks.assert_close(got, arg.grad, name=name, atol=1e-3, rtol=1e-3)
    except AssertionError as exc:
        return Verdict.failed(str(getattr(exc, "report", exc))[:600])
    ratio = outputs["saved_bytes"] / reference_bytes
    target = float(params.get("max_ratio", 0.6))
    figures = {"saved_bytes": outputs["saved_bytes"], "reference_bytes": reference_bytes, "ratio": ratio}
    if ratio <= target:
        return Verdict(1.0, f"outputs and gradients correct; saves {outputs['saved_bytes']} bytes vs "
                            f"{reference_bytes} for Conv->BN ({ratio:.0%})", figures)
    return Verdict(1 / 3, f"outputs and gradients correct, but saves {outputs['saved_bytes']} bytes vs "
                          f"{reference_bytes} for Conv->BN ({ratio:.0%}; needs at most {target:.0%}): "
                          "recompute the convolution in backward instead of saving it", figures)


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


MEMORY_INSTRUMENTS = ("autograder.labs.lab02_fusion._saved_tensor_bytes", *_common.SAVED_TENSOR_INSTRUMENTS)
# ConvBN's saved bytes are measured in the child: only its screened class and function run there
# (engine/artefacts.py), so no cell-level code shares the process with the measurement.
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
             scope=CONVBN_SCOPE, description="ConvBN recompute: correct and >= 40% fewer saved bytes"),
        Item("softmax_speed", 2, ("softmax_kernel_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=("softmax_kernel",),
             description="speed vs torch.softmax (GPU profiles)"),
    ],
)
