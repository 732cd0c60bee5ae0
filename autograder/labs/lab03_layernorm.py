"""Graded items of lab 03 layernorm: fused forward and backward kernels, stability, training."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs._common import on_device, per_case, require_tensor, triton_kernel
from fastdl_lab import checks

# Bound before any student cell runs (see lab01_gemm).
from fastdl_lab.layernorm import layer_norm as _layer_norm

KERNELS = {"fwd": "layernorm_fwd_kernel", "bwd_dx": "layernorm_bwd_dx_kernel", "bwd_dwdb": "layernorm_bwd_dwdb_kernel"}


def _kernels(ns: dict, *which: str) -> dict:
    return {key: triton_kernel(ns, KERNELS[key]) for key in which}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed % (1 << 63))


def _case(gen: torch.Generator, rows: int, cols: int, dtype, *, hard: bool = True) -> dict:
    # Rows with their own offsets and scales: a large mean or a tiny variance must not matter.
    # Gradients are judged at plain fp32 tolerances, so their inputs are well conditioned.
    offset = torch.randn(rows, 1, generator=gen) * (50 if hard else 2)
    scale = torch.rand(rows, 1, generator=gen) * 3 + (0.01 if hard else 0.5)
    return {
        "x": (torch.randn(rows, cols, generator=gen) * scale + offset).to(dtype),
        "w": (torch.rand(cols, generator=gen) + 0.5).to(dtype),
        "b": torch.randn(cols, generator=gen).to(dtype),
        "dy": torch.randn(rows, cols, generator=gen).to(dtype),
    }


def _forward_inputs(dtype):
    def make(seed: int, params: dict) -> dict:
        gen = _generator(seed)
        cases = []
        for rows, cols, block_n in params["shapes"]:
            cases.append({**_case(gen, rows, cols, dtype), "block_n": block_n})
        return {"cases": cases, "eps": 1e-5}
    return make


def _labels(inputs: dict) -> list[str]:
    return [f"{tuple(c['x'].shape)} {str(c['x'].dtype)[6:]} block_n={c['block_n']}" for c in inputs["cases"]]


def forward_drive(ns: dict, inputs: dict) -> list:
    kernels = _kernels(ns, "fwd")
    with torch.no_grad():
        return [_layer_norm(on_device(c["x"]), on_device(c["w"]), on_device(c["b"]), inputs["eps"],
                            kernels=kernels, block_n=c["block_n"]).cpu() for c in inputs["cases"]]


def forward_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.layernorm import check_layer_norm

    cases, labels = inputs["cases"], _labels(inputs)
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(outputs).__name__}")

    def check_one(i: int) -> None:
        c = cases[i]
        require_tensor(outputs[i], f"y for {labels[i]}")
        # fp32 tolerance widened only by what rounding a large row mean costs any fp32 kernel;
        # fp16 by the low-precision rule.
        check_layer_norm(outputs[i], c["x"], c["w"], c["b"], inputs["eps"], name=f"y for {labels[i]}")

    return per_case(labels, check_one)


def backward_inputs(seed: int, params: dict) -> dict:
    gen = _generator(seed)
    cases = []
    for rows, cols, block_n, dtype in params["cases"]:
        cases.append({**_case(gen, rows, cols, getattr(torch, dtype), hard=False), "block_n": block_n})
    return {"cases": cases, "eps": 1e-5}


def backward_drive(ns: dict, inputs: dict) -> list:
    kernels = _kernels(ns, "fwd", "bwd_dx", "bwd_dwdb")
    grads = []
    for c in inputs["cases"]:
        x, w, b = (on_device(c[k]).clone().requires_grad_() for k in ("x", "w", "b"))
        y = _layer_norm(x, w, b, inputs["eps"], kernels=kernels, block_n=c["block_n"])
        y.backward(on_device(c["dy"]))
        grads.append([None if t.grad is None else t.grad.cpu() for t in (x, w, b)])
    return grads


def backward_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.layernorm import check_layer_norm_grads

    cases, labels = inputs["cases"], _labels(inputs)
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} gradient triples, got {type(outputs).__name__}")

    def check_one(i: int) -> None:
        c = cases[i]
        for grad, name in zip(outputs[i], ("dx", "dweight", "dbias"), strict=True):
            require_tensor(grad, f"{name} for {labels[i]} (is the backward wired?)")
        check_layer_norm_grads(outputs[i], c["x"], c["w"], c["b"], c["dy"], inputs["eps"], name=labels[i])

    return per_case(labels, check_one)


def stability_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab.layernorm import catastrophic_input

    rows, cols, block_n = params["shape"]
    x = catastrophic_input(rows, cols, seed=seed % (1 << 31))
    gen = _generator(seed + 1)
    return {"cases": [{"x": x, "w": torch.rand(cols, generator=gen) + 0.5, "b": torch.randn(cols, generator=gen),
                       "block_n": block_n}], "eps": 1e-5}


def stability_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.layernorm import naive_variance_layer_norm, stability_error

    c = inputs["cases"][0]
    naive_error = stability_error(naive_variance_layer_norm(c["x"], c["w"], c["b"], inputs["eps"]), c["x"], c["w"], c["b"])
    verdict = forward_check(inputs, outputs, params)
    note = f"; on this input E[x^2]-E[x]^2 is off by up to {naive_error:.3g}"
    return Verdict(verdict.fraction, verdict.reason + note, {"naive_max_error": naive_error})


def training_inputs(seed: int, params: dict) -> dict:
    gen = _generator(seed)
    d_in, d_hidden, d_out, batch = params["dims"]
    return {
        "w1": torch.randn(d_hidden, d_in, generator=gen) * 0.3, "b1": torch.randn(d_hidden, generator=gen) * 10,
        "gamma": torch.rand(d_hidden, generator=gen) + 0.5, "beta": torch.randn(d_hidden, generator=gen),
        "w2": torch.randn(d_out, d_hidden, generator=gen) * 0.3,
        "x": torch.randn(int(params.get("steps", 3)), batch, d_in, generator=gen),
        "target": torch.randn(int(params.get("steps", 3)), batch, d_out, generator=gen),
        "lr": 0.05, "block_n": params.get("block_n"),
    }


def _train(inputs: dict, norm) -> list[torch.Tensor]:
    params = [on_device(inputs[k]).clone().requires_grad_() for k in ("w1", "b1", "gamma", "beta", "w2")]
    w1, b1, gamma, beta, w2 = params
    for x, target in zip(inputs["x"], inputs["target"]):
        h = norm(on_device(x) @ w1.T + b1, gamma, beta)
        loss = ((h @ w2.T - on_device(target)) ** 2).mean()
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= inputs["lr"] * p.grad
    return [p.detach().cpu() for p in params]


def training_drive(ns: dict, inputs: dict) -> list:
    kernels = _kernels(ns, "fwd", "bwd_dx", "bwd_dwdb")
    return _train(inputs, lambda h, g, b: _layer_norm(h, g, b, 1e-5, kernels=kernels, block_n=inputs["block_n"]))


def training_check(inputs: dict, outputs, params: dict) -> Verdict:
    expected = _train(inputs, lambda h, g, b: F.layer_norm(h, h.shape[-1:], g, b, 1e-5))
    names = ("w1", "b1", "gamma", "beta", "w2")
    try:
        for name, got, want in zip(names, outputs, expected, strict=True):
            checks.assert_close(got, want, name=f"{name} after {len(inputs['x'])} SGD steps", atol=1e-4, rtol=1e-4)
    except (AssertionError, ValueError) as exc:
        return Verdict.failed(str(getattr(exc, "report", exc))[:600])
    return Verdict.passed(f"{len(inputs['x'])} SGD steps through the Triton LayerNorm match F.layer_norm")


def speed_inputs(seed: int, params: dict) -> dict:
    rows, cols = params.get("shape", [4096, 4096])
    gen = _generator(seed)
    return {"cases": [{**_case(gen, rows, cols, torch.float16), "block_n": None}], "eps": 1e-5}


def speed_timed(ns: dict, inputs: dict):
    kernels = _kernels(ns, "fwd")
    c = inputs["cases"][0]
    x, w, b = (on_device(c[k]) for k in ("x", "w", "b"))
    return lambda: [_layer_norm(x, w, b, inputs["eps"], kernels=kernels).detach()]


def speed_baseline(_ns: dict, inputs: dict):
    c = inputs["cases"][0]
    x, w, b = (on_device(c[k]) for k in ("x", "w", "b"))
    return lambda: [F.layer_norm(x, x.shape[-1:], w, b, inputs["eps"])]


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return forward_check(inputs, [o.cpu() for o in outputs], params)


FORWARD, ALL_KERNELS = (KERNELS["fwd"],), tuple(KERNELS.values())

LAB = LabSpec(
    name="03_layernorm",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("layernorm_fwd_fp32", 3, ("layernorm_fwd_code",), _forward_inputs(torch.float32), forward_drive, forward_check,
             kernels=FORWARD, description="Triton LayerNorm forward, fp32, ragged and multi-block rows"),
        Item("layernorm_fwd_fp16", 2, ("layernorm_fwd_code",), _forward_inputs(torch.float16), forward_drive, forward_check,
             kernels=FORWARD, description="Triton LayerNorm forward, fp16 (low-precision rule)"),
        Item("layernorm_bwd", 3, ("layernorm_fwd_code", "layernorm_bwd_code"), backward_inputs, backward_drive, backward_check,
             kernels=ALL_KERNELS, description="dx, dgamma, dbeta in fp32 and fp16"),
        Item("layernorm_stability", 2, ("layernorm_fwd_code",), stability_inputs, forward_drive, stability_check,
             kind="mechanism", kernels=FORWARD, description="large mean, tiny variance: where E[x^2]-E[x]^2 fails"),
        Item("layernorm_training", 2, ("layernorm_fwd_code", "layernorm_bwd_code"), training_inputs, training_drive,
             training_check, kernels=ALL_KERNELS, description="the autograd wrapper in a short training loop"),
        Item("layernorm_speed", 2, ("layernorm_fwd_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=FORWARD,
             description="speed vs F.layer_norm (GPU profiles)"),
    ],
)
