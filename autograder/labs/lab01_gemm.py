"""Graded items of lab 01 gemm: the student's tiled Triton matmul, its launch order, its speed."""

from __future__ import annotations

import random

import torch

from autograder.engine.items import Item, LabSpec, Verdict
from fastdl_lab import checks

# Bound when the child imports this module, before any student cell runs, so a solution cell
# that rebinds gemm.matmul cannot swap the launcher the grader calls.
from fastdl_lab.gemm import matmul as _launch


def _operands(seed: int, shapes, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    for i, (m, n, k) in enumerate(shapes):
        a = checks.randn(m, k, dtype=dtype, seed=seed + 2 * i)
        b = checks.randn(k, n, dtype=dtype, seed=seed + 2 * i + 1)
        pairs.append((a, b))
    return pairs


def _student_kernel(ns: dict):
    kernel = ns.get("matmul_kernel")
    if kernel is None:
        raise NameError("the solution cell does not define matmul_kernel")
    # A Triton kernel (JITFunction, or InterpretedFunction on the CPU) is launched as kernel[grid];
    # a plain function here would mean the library is being called instead of a kernel.
    if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "fn"):
        raise TypeError("matmul_kernel must be a @triton.jit kernel")
    return kernel


def _matmul_inputs(dtype):
    def make(seed: int, params: dict) -> dict:
        pairs = _operands(seed % (1 << 31), params["shapes"], dtype)
        return {"a": [a for a, _ in pairs], "b": [b for _, b in pairs]}
    return make


def matmul_drive(ns: dict, inputs: dict) -> list:
    kernel = _student_kernel(ns)
    on_gpu = torch.cuda.is_available()
    outs = []
    for a, b in zip(inputs["a"], inputs["b"]):
        if on_gpu:
            a, b = a.cuda(), b.cuda()
        outs.append(_launch(a, b, kernel=kernel).cpu())
    return outs


def _matmul_check(inputs: dict, outputs, params: dict) -> Verdict:
    failures = []
    shapes = [(a.shape[0], b.shape[1], a.shape[1]) for a, b in zip(inputs["a"], inputs["b"])]
    if not isinstance(outputs, list) or len(outputs) != len(shapes):
        return Verdict.failed(f"expected {len(shapes)} results, got {type(outputs).__name__}")
    for (a, b), out, shape in zip(zip(inputs["a"], inputs["b"]), outputs, shapes):
        reference = a.double() @ b.double()
        try:
            if a.dtype == torch.float32 and not params.get("tf32"):
                checks.assert_close(out, reference.float(), name=f"C for M,N,K={shape}", atol=1e-4, rtol=1e-4)
            else:
                # fp16 (and TF32 on GPUs): no worse than twice PyTorch's own low-precision error.
                lowp = (a.cuda() @ b.cuda()).cpu() if torch.cuda.is_available() else a @ b
                checks.assert_low_precision_close(out, reference.float(), lowp, name=f"C for M,N,K={shape}")
        except AssertionError as exc:
            failures.append(str(exc).strip().splitlines()[0] if not hasattr(exc, "report") else exc.report)
    passed = len(shapes) - len(failures)
    if not failures:
        return Verdict.passed(f"correct on all {len(shapes)} hidden shapes {shapes}")
    return Verdict(passed / len(shapes), f"{passed}/{len(shapes)} hidden shapes correct; first failure: {failures[0][:600]}")


def grouped_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = [(rng.randint(1, 13), rng.randint(1, 13), rng.randint(1, 6)) for _ in range(int(params.get("cases", 12)))]
    return {"cases": cases}


def grouped_drive(ns: dict, inputs: dict) -> list[list[list[int]]]:
    fn = ns["grouped_pid"]
    return [[[int(v) for v in fn(pid, m, n, g)] for pid in range(m * n)] for m, n, g in inputs["cases"]]


def grouped_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.gemm import grouped_pid_ref, row_major_pid, tiles_touched

    for (m, n, g), got in zip(inputs["cases"], outputs, strict=True):
        for pid, pair in enumerate(got):
            expected = list(grouped_pid_ref(pid, m, n, g))
            if list(pair) != expected:
                return Verdict.failed(
                    f"grouped_pid({pid}, num_pid_m={m}, num_pid_n={n}, group_m={g}) gave {tuple(pair)}, expected {tuple(expected)}")
    wave = 16
    grouped = tiles_touched(grouped_pid_ref, 16, 16, wave, group_m=4)
    row = tiles_touched(row_major_pid, 16, 16, wave)
    return Verdict.passed(
        f"matches on {len(inputs['cases'])} hidden grids; a wave of {wave} programs on 16x16 tiles "
        f"loads {grouped} blocks grouped vs {row} row-major",
        tiles_grouped=grouped, tiles_row_major=row)


def speed_inputs(seed: int, params: dict) -> dict:
    n = int(params.get("size", 4096))
    (a, b), = _operands(seed % (1 << 31), [(n, n, n)], torch.float16)
    return {"a": [a], "b": [b]}


def _on_device(inputs: dict):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return inputs["a"][0].to(device), inputs["b"][0].to(device)


def speed_timed(ns: dict, inputs: dict):
    kernel = _student_kernel(ns)
    a, b = _on_device(inputs)
    return lambda: [_launch(a, b, kernel=kernel)]


def speed_baseline(inputs: dict):
    a, b = _on_device(inputs)
    return lambda: [torch.matmul(a, b)]


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return _matmul_check(inputs, [o.cpu() for o in outputs], params)


LAB = LabSpec(
    name="01_gemm",
    preamble="from fastdl_lab import device\nfrom fastdl_lab import gemm\n",
    items=[
        Item("matmul_fp32", 4, ("matmul_kernel_code",), _matmul_inputs(torch.float32), matmul_drive, _matmul_check,
             description="Triton matmul, fp32, hidden ragged shapes"),
        Item("matmul_fp16", 2, ("matmul_kernel_code",), _matmul_inputs(torch.float16), matmul_drive, _matmul_check,
             description="Triton matmul, fp16 (low-precision rule)"),
        Item("grouped_order", 2, ("grouped_order_code",), grouped_inputs, grouped_drive, grouped_check,
             kind="mechanism", description="grouped program ordering"),
        Item("matmul_speed", 2, ("matmul_kernel_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, description="speed vs torch.matmul (GPU profiles)"),
    ],
)
