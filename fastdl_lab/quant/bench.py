"""The lab 09 quantisation benchmark spec, ``benchmark`` and ``check``.

Four experiments, one row per figure (``benchmarks/results/quant.csv``):

- ``quant_error``: per-tensor against per-channel int8 and int4 on a trained layer, the same
  layer with its BatchNorm folded in, and a freshly initialised layer;
- ``int8_matmul``: on a CPU, PyTorch's int8 x int8 -> int32 product (``torch._int_mm``) against
  its fp32 matmul, and the Triton kernel's exactness under the interpreter (its timing there
  would be Python's, so it is left to a GPU); on a GPU, the Triton kernel and ``torch._int_mm``
  against an fp16 ``torch.matmul``. Also a W8A8Linear's error against its float Linear;
- ``ptq_qat``: float, PTQ and QAT test accuracy at 4 bits, and at 8 bits through the int8
  kernel, over several seeds;
- ``inference``: eager against BatchNorm-folded against ``torch.compile``d inference, with the
  ops one forward dispatches (``forward_ops``), the figure that does not depend on the machine's load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch import nn

from fastdl_lab import checks, device
# Names, not modules: the package exports functions called ``int8_matmul`` and ``qat`` that hide
# the modules of the same name as its attributes.
from fastdl_lab.quant.formats import (dequantize, quantization_error, quantize, quantize_activation, row_range_ratio,
                                      train_regression_mlp)
from fastdl_lab.quant.fusion import bn_mlp, fold_linear_bn, fold_linear_bn_model, forward_ops
from fastdl_lab.quant.w8a8 import W8A8Linear, check_int8_matmul, int8_matmul, int8_matmul_ref, quantize_linears
from fastdl_lab.quant.training import accuracy, experiment, fake_quant, make_task, ptq, train_float

BENCHMARK = {
    "name": "quant",
    "error": {"seed": 0, "bits": [8, 4]},
    "matmul": {"cpu": [512, 1024, 2048], "gpu": [2048, 4096, 8192]},
    # Ragged in every dimension, one and several tiles, and K deep enough for sums past 2^24.
    "exact_shapes": [(1, 1, 1), (37, 45, 50), (130, 70, 200), (65, 129, 2100)],
    "qat_seeds": [0, 1, 2, 3, 4],
    "inference": {"cpu": {"batch": 256, "d_in": 256, "width": 1024, "depth": 3},
                  "gpu": {"batch": 8192, "d_in": 1024, "width": 4096, "depth": 3}},
}
_COLUMNS = ("experiment", "variant", "layer", "size", "bits", "seed", "median_s", "iqr_s", "speedup", "ci_low",
            "ci_high", "tops", "ops", "max_abs", "rel_fro", "sqnr_db", "range_ratio", "accuracy", "exact", "note")


def _row(**values) -> dict:
    # One fixed set of columns, so every row of every run appends to the same CSV.
    return {c: values.get(c) for c in _COLUMNS}


def _fresh_layer(rows: int, cols: int, seed: int) -> torch.Tensor:
    """nn.Linear's default initialisation (uniform in +-1/sqrt(fan_in)), seeded."""
    bound = cols ** -0.5
    return (torch.rand(rows, cols, generator=checks.generator(seed)) * 2 - 1) * bound


def _error_rows(log) -> list[dict]:
    spec = BENCHMARK["error"]
    model = train_regression_mlp(spec["seed"])
    trained = model[0].weight.detach()
    layers = {"trained": trained,
              "trained, BatchNorm folded": fold_linear_bn(model[0], model[1]).weight.detach(),
              "fresh init": _fresh_layer(*trained.shape, seed=spec["seed"])}
    rows = []
    for layer, w in layers.items():
        ratio = row_range_ratio(w)
        for bits in spec["bits"]:
            for variant, axis in (("per_tensor", None), ("per_channel", 0)):
                err = quantization_error(w, bits=bits, axis=axis)
                rows.append(_row(experiment="quant_error", variant=variant, layer=layer,
                                 size="x".join(map(str, w.shape)), bits=bits, seed=spec["seed"],
                                 range_ratio=ratio, **err))
                log(f"quant_error {layer:>26} int{bits} {variant:>11}: rel_fro {err['rel_fro']:.4f}, "
                    f"max_abs {err['max_abs']:.2e}, SQNR {err['sqnr_db']:.1f} dB (row ranges span {ratio:.1f}x)")
    return rows


def _int8_operands(m: int, n: int, k: int, seed: int, dev: str):
    a_q, a_scale = quantize_activation(checks.randn(m, k, seed=seed))
    w_q, w_scale, _ = quantize(checks.randn(n, k, seed=seed + 1), axis=0)
    return tuple(t.contiguous().to(dev) for t in (a_q, a_scale, w_q, w_scale))


def _machine_note() -> str | None:
    """What the timings of a CPU run were up against: these machines share their cores."""
    if device.has_gpu():
        return None
    return f"{os.cpu_count()} CPU cores shared with other processes (load average {os.getloadavg()[0]:.1f} at start)"


def _matmul_rows(reps: int, log, note: str | None) -> list[dict]:
    from fastdl_lab import timing

    gpu = device.has_gpu()
    dev = "cuda" if gpu else "cpu"
    rows = []
    for m, n, k in BENCHMARK["exact_shapes"]:
        ops = _int8_operands(m, n, k, seed=m + n + k, dev=dev)
        exact = bool(torch.equal(int8_matmul(*ops).cpu(),
                                 int8_matmul_ref(*(t.cpu() for t in ops))))
        rows.append(_row(experiment="int8_matmul", variant="triton_int8 exactness", size=f"{m}x{n}x{k}", bits=8,
                         exact=exact, note="interpreter" if device.interpreting() else None))
        log(f"int8_matmul triton {m}x{n}x{k}: {'bit-exact' if exact else 'NOT exact'} against int8_matmul_ref")

    layer = train_regression_mlp(0)[3]
    x = checks.randn(512, layer.in_features, seed=3)
    with torch.no_grad():
        want = layer(x).double()
        got = W8A8Linear(layer).to(dev)(x.to(dev)).double().cpu()
    rel = float((got - want).norm() / want.norm())
    rows.append(_row(experiment="int8_matmul", variant="W8A8Linear vs fp32 Linear", layer="trained",
                     size=f"512x{layer.out_features}x{layer.in_features}", bits=8, rel_fro=rel,
                     max_abs=float((got - want).abs().max())))
    log(f"W8A8Linear against its fp32 Linear: relative error {rel:.4f}")

    for size in BENCHMARK["matmul"]["gpu" if gpu else "cpu"]:
        a_q, a_scale, w_q, w_scale = _int8_operands(size, size, size, seed=size, dev=dev)
        dtype = torch.float16 if gpu else torch.float32
        base = str(dtype).replace("torch.", "")
        a, w = a_q.to(dtype), w_q.to(dtype)
        candidates = {"torch._int_mm": lambda: torch._int_mm(a_q, w_q.T)}
        if gpu:
            candidates["triton_int8"] = lambda: int8_matmul(a_q, a_scale, w_q, w_scale)
        for variant, fn in candidates.items():
            cmp = timing.compare(fn, lambda: a @ w.T, reps=reps)
            t = cmp.candidate
            rows.append(_row(experiment="int8_matmul", variant=f"{variant} vs {base} matmul",
                             size=f"{size}x{size}x{size}", bits=8, median_s=t.median, iqr_s=t.iqr,
                             speedup=cmp.speedup, ci_low=cmp.ci_low, ci_high=cmp.ci_high,
                             tops=2 * size**3 / t.median / 1e12, note=note))
            log(f"int8_matmul {variant:>14} {size}^3: {t.median * 1e3:8.3f} ms, {cmp.speedup:.2f}x "
                f"{base} torch.matmul ({cmp.baseline.median * 1e3:.3f} ms)")
    if not gpu:
        rows.append(_row(experiment="int8_matmul", variant="triton_int8 timing", bits=8,
                         note="needs a GPU (under the interpreter the timing is Python's, not the kernel's)"))
        log("triton_int8 timing: needs a GPU (under the interpreter the timing is Python's, not the kernel's)")
    return rows


def _qat_rows(log) -> list[dict]:
    rows = []
    for seed in BENCHMARK["qat_seeds"]:
        result = experiment(seed)
        task = make_task(seed)
        model = train_float(seed)
        # 8 bits: the same per-tensor fake-quant PTQ, and the real W8A8 path (per-channel weights,
        # per-row activations, the Triton kernel).
        result["ptq_int8"] = accuracy(ptq(model, 8, task.train[0]), task.test)
        dev = "cuda" if device.has_gpu() else "cpu"
        result["w8a8_kernel"] = accuracy(quantize_linears(model).to(dev), tuple(t.to(dev) for t in task.test))
        for variant, bits in (("float", None), ("ptq", result["bits"]), ("qat", result["bits"]),
                              ("ptq_int8", 8), ("w8a8_kernel", 8)):
            rows.append(_row(experiment="ptq_qat", variant=variant, seed=seed, bits=bits,
                             accuracy=result[variant], note="W4A8 per-tensor" if bits == 4 else None))
        log(f"ptq_qat seed {seed}: float {result['float']:.3f}, int4 PTQ {result['ptq']:.3f}, "
            f"int4 QAT {result['qat']:.3f}, int8 PTQ {result['ptq_int8']:.3f}, "
            f"W8A8 kernel {result['w8a8_kernel']:.3f}")
    return rows


def _inference_rows(reps: int, log, note: str | None) -> list[dict]:
    from fastdl_lab import timing

    gpu = device.has_gpu()
    spec = BENCHMARK["inference"]["gpu" if gpu else "cpu"]
    dev = "cuda" if gpu else "cpu"
    model = bn_mlp(spec["d_in"], spec["width"], spec["depth"]).to(dev)
    folded = fold_linear_bn_model(model)
    x = checks.randn(spec["batch"], spec["d_in"], seed=5, device=dev)
    size = f"{spec['batch']}x{spec['d_in']}, {spec['depth']}x{spec['width']}"
    variants: dict[str, nn.Module | Callable] = {"folded": folded, "compiled": torch.compile(model),
                                                 "folded+compiled": torch.compile(folded)}
    rows = []
    with torch.inference_mode():
        expected = model(x)
        for variant, fn in variants.items():
            start = time.perf_counter()
            got = fn(x)
            device.synchronize()
            first = time.perf_counter() - start
            cmp = timing.compare(lambda: fn(x), lambda: model(x), reps=reps)
            diff = float((got - expected).abs().max())
            # A compiled graph runs generated code, not the ops it was traced from: not counted.
            ops = forward_ops(fn, x) if variant == "folded" else None
            if variant == "folded":
                rows.append(_row(experiment="inference", variant="eager", size=size, median_s=cmp.baseline.median,
                                 iqr_s=cmp.baseline.iqr, speedup=1.0, ops=forward_ops(model, x), note=note))
            rows.append(_row(experiment="inference", variant=variant, size=size, median_s=cmp.candidate.median,
                             iqr_s=cmp.candidate.iqr, speedup=cmp.speedup, ci_low=cmp.ci_low,
                             ci_high=cmp.ci_high, ops=ops, max_abs=diff,
                             note="; ".join(filter(None, (f"first call {first:.1f} s", note)))))
            log(f"inference {variant:>16}: {cmp.candidate.median * 1e3:.3f} ms, {cmp.speedup:.2f}x eager "
                f"({cmp.baseline.median * 1e3:.3f} ms); max |diff| {diff:.1e}; first call {first:.1f} s")
    return rows


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Every experiment this machine can run; one dict per row, same columns."""
    note = _machine_note()
    return _error_rows(log) + _matmul_rows(reps, log, note) + _qat_rows(log) + _inference_rows(reps, log, note)


def check() -> None:
    """The kernel against the reference, quantiser round trips, folding, the STE; raises on failure."""
    for m, n, k in BENCHMARK["exact_shapes"][:3]:
        ops = _int8_operands(m, n, k, seed=1, dev="cuda" if device.has_gpu() else "cpu")
        check_int8_matmul(int8_matmul(*ops), *ops, name=f"int8_matmul {m}x{n}x{k}")
    w = checks.randn(20, 33, seed=2)
    for axis in (None, 0, 1):
        for symmetric in (True, False):
            q, scale, zp = quantize(w, symmetric=symmetric, axis=axis)
            # Round to nearest: every element within half a step of where it came from.
            err = float((dequantize(q, scale, zp, axis) - w).abs().max())
            assert err <= 0.5 * float(scale.max()) * (1 + 1e-6), (axis, symmetric, err)
    model = bn_mlp(16, 32, 2)
    x = checks.randn(8, 16, seed=3)
    with torch.no_grad():
        checks.assert_close(fold_linear_bn_model(model)(x), model(x), atol=1e-5, rtol=1e-5, name="folded")
    x = torch.tensor([-2.0, -0.4, 0.3, 5.0], requires_grad=True)
    fake_quant(x, torch.tensor(0.5), bits=3).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 0.0], x.grad
    print("quant: checks passed")
