"""Graded items of lab 00 measure: the roofline calculators and a timing loop that tells the truth."""

from __future__ import annotations

import math
import random

from autograder.engine.items import Item, LabSpec, Verdict

CALCULATORS = ("matmul_flops", "matmul_bytes", "arithmetic_intensity", "attainable_tflops", "mfu")


def roofline_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for _ in range(int(params.get("cases", 24))):
        cases.append({
            "m": rng.randint(1, 8192), "n": rng.randint(1, 8192), "k": rng.randint(1, 8192),
            "bytes_per_elem": rng.choice([1, 2, 4, 8]),
            "flops": rng.uniform(1e6, 1e15), "bytes_moved": rng.uniform(1e3, 1e12),
            "intensity": 10 ** rng.uniform(-2, 4), "peak_tflops": rng.uniform(5, 1000),
            "peak_bw_gbs": rng.uniform(50, 5000), "achieved_tflops": rng.uniform(0.1, 900),
        })
    return {"cases": cases}


def _call_all(ns: dict, c: dict) -> list[float]:
    return [
        float(ns["matmul_flops"](c["m"], c["n"], c["k"])),
        float(ns["matmul_bytes"](c["m"], c["n"], c["k"], c["bytes_per_elem"])),
        float(ns["arithmetic_intensity"](c["flops"], c["bytes_moved"])),
        float(ns["attainable_tflops"](c["intensity"], c["peak_tflops"], c["peak_bw_gbs"])),
        float(ns["mfu"](c["achieved_tflops"], c["peak_tflops"])),
    ]


def roofline_drive(ns: dict, inputs: dict) -> list[list[float]]:
    return [_call_all(ns, c) for c in inputs["cases"]]


def _expected(c: dict) -> list[float]:
    from fastdl_lab import measure

    return [
        measure.matmul_flops_ref(c["m"], c["n"], c["k"]),
        measure.matmul_bytes_ref(c["m"], c["n"], c["k"], c["bytes_per_elem"]),
        measure.arithmetic_intensity_ref(c["flops"], c["bytes_moved"]),
        measure.attainable_tflops_ref(c["intensity"], c["peak_tflops"], c["peak_bw_gbs"]),
        measure.mfu_ref(c["achieved_tflops"], c["peak_tflops"]),
    ]


def roofline_check(inputs: dict, outputs, params: dict) -> Verdict:
    wrong: dict[str, str] = {}
    for c, got in zip(inputs["cases"], outputs, strict=True):
        for name, g, e in zip(CALCULATORS, got, _expected(c), strict=True):
            if name not in wrong and not math.isclose(float(g), e, rel_tol=1e-6):
                args = {k: c[k] for k in ("m", "n", "k", "bytes_per_elem")} if name.startswith("matmul") else None
                wrong[name] = f"{name} gave {float(g):.6g}, expected {e:.6g}" + (f" for {args}" if args else "")
    right = len(CALCULATORS) - len(wrong)
    if not wrong:
        return Verdict.passed(f"all {len(CALCULATORS)} calculators correct on {len(inputs['cases'])} hidden cases")
    return Verdict(right / len(CALCULATORS), f"{right}/{len(CALCULATORS)} calculators correct; " + "; ".join(wrong.values()))


def timing_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    op = float(params.get("op_seconds", 0.02)) * rng.uniform(0.8, 1.25)
    return {"op_seconds": op, "compile_seconds": float(params.get("compile_seconds", 0.4)), "iters": int(params.get("iters", 6))}


def timing_drive(ns: dict, inputs: dict) -> list[float]:
    from fastdl_lab.measure import SimulatedAsyncDevice

    with SimulatedAsyncDevice(op_seconds=inputs["op_seconds"], compile_seconds=inputs["compile_seconds"]) as dev:
        return [float(s) for s in ns["time_op"](dev, iters=inputs["iters"], warmup=2)]


def timing_check(inputs: dict, samples, params: dict) -> Verdict:
    op, compile_s, iters = inputs["op_seconds"], inputs["compile_seconds"], inputs["iters"]
    samples = [float(s) for s in samples]
    if len(samples) != iters:
        return Verdict.failed(f"time_op returned {len(samples)} samples for iters={iters}")
    # Sleeps only ever run long, so a synced sample is never much below the true op time.
    if min(samples) < 0.8 * op:
        return Verdict.failed(
            f"a sample of {min(samples) * 1e3:.2f} ms for an op that takes {op * 1e3:.1f} ms: "
            "the loop does not wait for the device (missing synchronize)", samples=samples)
    if max(samples) > op + 0.5 * compile_s:
        return Verdict.failed(
            f"a sample of {max(samples) * 1e3:.0f} ms includes the {compile_s * 1e3:.0f} ms first-call "
            "compilation: warm up before timing", samples=samples)
    return Verdict.passed(f"median {sorted(samples)[iters // 2] * 1e3:.1f} ms for a {op * 1e3:.1f} ms op", samples=samples)


LAB = LabSpec(
    name="00_measure",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("roofline", 4, ("roofline_code",), roofline_inputs, roofline_drive, roofline_check,
             kind="correctness", description="FLOPs, bytes, intensity, attainable FLOP/s and MFU"),
        Item("timing", 3, ("timing_code",), timing_inputs, timing_drive, timing_check,
             kind="mechanism", description="per-iteration time of an asynchronous op, warmed up and synced"),
    ],
)
