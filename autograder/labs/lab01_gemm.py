"""Graded items of lab 01 gemm: the warm-up row-sum kernel, the student's tiled Triton matmul, its
launch order, and its speed with the launch configuration the student tuned."""

from __future__ import annotations

import random

import torch

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs._common import on_device, per_case, require_tensor, triton_kernel
from fastdl_lab import checks

# Bound when the child imports this module, before any student cell runs, so a solution cell
# that rebinds gemm.matmul cannot swap the launcher the grader calls.
from fastdl_lab.gemm import check_config, check_matmul
from fastdl_lab.gemm import matmul as _launch
from fastdl_lab.rowsum import check_row_sum
from fastdl_lab.rowsum import row_sum as _row_sum


# --- warm-up: row sums ---------------------------------------------------------------------

def row_sum_inputs(seed: int, params: dict) -> dict:
    """Per case a base tensor and how the graded matrix is viewed in it: the whole base, a window
    with NaN all around (padded rows: a missing column or row mask reads NaN), or its transpose."""
    bases, views, blocks = [], [], []
    for i, case in enumerate(params["cases"]):
        m, n = case["shape"]
        layout = case.get("layout", "rows")
        dtype = getattr(torch, case.get("dtype", "float32"))
        values = checks.randn(m, n, dtype=dtype, seed=(seed + i) % (1 << 31))
        if layout == "rows":
            base, view = values, [layout, m, n, 0, 0]
        elif layout == "padded":
            r0, c0 = case.get("offset", [1, 5])
            base = torch.full((m + r0 + 2, n + c0 + 11), float("nan"), dtype=dtype)
            base[r0:r0 + m, c0:c0 + n] = values
            view = [layout, m, n, r0, c0]
        elif layout == "transposed":
            base, view = values.t().contiguous(), [layout, m, n, 0, 0]
        else:
            raise ValueError(f"row_sum case {i}: unknown layout {layout!r}")
        bases.append(base)
        views.append(view)
        blocks.append(list(case.get("blocks", [])))
    return {"bases": bases, "views": views, "blocks": blocks}


def _row_sum_matrix(base: torch.Tensor, view: list) -> torch.Tensor:
    layout, m, n, r0, c0 = view
    if layout == "padded":
        return base[r0:r0 + m, c0:c0 + n]
    return base.t() if layout == "transposed" else base


def row_sum_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, "row_sum_kernel")
    sums = []
    for base, view, blocks in zip(inputs["bases"], inputs["views"], inputs["blocks"], strict=True):
        sizes = dict(zip(("block_m", "block_n"), blocks))
        sums.append(_row_sum(_row_sum_matrix(on_device(base), view), kernel=kernel, **sizes).cpu())
    return sums


def row_sum_check(inputs: dict, outputs, params: dict) -> Verdict:
    views = inputs["views"]
    if not isinstance(outputs, list) or len(outputs) != len(views):
        return Verdict.failed(f"expected {len(views)} results, got {type(outputs).__name__}")
    labels = [f"{layout} {m}x{n}" + (f" {base.dtype}".replace("torch.", "") if base.dtype != torch.float32 else "")
              + (f" blocks {bl[0]}x{bl[1]}" if bl else "")
              for (layout, m, n, _, _), base, bl in zip(views, inputs["bases"], inputs["blocks"], strict=True)]

    def check_one(i: int) -> None:
        require_tensor(outputs[i], f"y for {labels[i]}")
        check_row_sum(outputs[i], _row_sum_matrix(inputs["bases"][i], views[i]), name=f"y for {labels[i]}")

    return per_case(labels, check_one)


# --- the tiled matmul ------------------------------------------------------------------------


def _operands(seed: int, shapes, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    for i, (m, n, k) in enumerate(shapes):
        a = checks.randn(m, k, dtype=dtype, seed=seed + 2 * i)
        b = checks.randn(k, n, dtype=dtype, seed=seed + 2 * i + 1)
        pairs.append((a, b))
    return pairs


def _matmul_inputs(dtype):
    def make(seed: int, params: dict) -> dict:
        pairs = _operands(seed % (1 << 31), params["shapes"], dtype)
        return {"a": [a for a, _ in pairs], "b": [b for _, b in pairs]}
    return make


def matmul_drive(ns: dict, inputs: dict) -> list:
    kernel = triton_kernel(ns, "matmul_kernel")
    return [_launch(on_device(a), on_device(b), kernel=kernel).cpu() for a, b in zip(inputs["a"], inputs["b"])]


def _matmul_check(inputs: dict, outputs, params: dict) -> Verdict:
    pairs = list(zip(inputs["a"], inputs["b"]))
    if not isinstance(outputs, list) or len(outputs) != len(pairs):
        return Verdict.failed(f"expected {len(pairs)} results, got {type(outputs).__name__}")
    labels = [f"M,N,K={(a.shape[0], b.shape[1], a.shape[1])}" for a, b in pairs]

    def check_one(i: int) -> None:
        a, b = pairs[i]
        require_tensor(outputs[i], f"C for {labels[i]}")
        # One rule for the course (fastdl_lab.gemm): fp32 tolerances on the CPU, and where fp16 or
        # TF32 tensor cores are involved, no worse than twice PyTorch's own error.
        check_matmul(on_device(outputs[i]), on_device(a), on_device(b), name=f"C for {labels[i]}")

    return per_case(labels, check_one)


def _short_band_case(rng: random.Random) -> tuple[int, int, int]:
    """A grid whose last band of ``group_m`` rows is shorter than the others."""
    while True:
        m, n, g = rng.randint(3, 13), rng.randint(1, 13), rng.randint(2, 6)
        if g < m and m % g:
            return m, n, g


def grouped_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    count = int(params.get("cases", 12))
    # Two grids at least with a shorter last band: an order that ignores it must meet one.
    cases = [_short_band_case(rng) for _ in range(2)]
    cases += [(rng.randint(1, 13), rng.randint(1, 13), rng.randint(1, 6)) for _ in range(count - 2)]
    rng.shuffle(cases)
    return {"cases": cases}


def grouped_drive(ns: dict, inputs: dict) -> list[list[list[int]]]:
    fn = ns["grouped_pid"]
    return [[[int(v) for v in fn(pid, m, n, g)] for pid in range(m * n)] for m, n, g in inputs["cases"]]


def grouped_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.gemm import grouped_pid_ref, row_major_pid, tiles_touched

    for (m, n, g), got in zip(inputs["cases"], outputs, strict=True):
        # Every program of the grid, each once: a shorter answer leaves programs unchecked.
        if not isinstance(got, list) or len(got) != m * n:
            return Verdict.failed(f"expected the tiles of all {m * n} programs of a {m}x{n} grid, "
                                  f"got {len(got) if isinstance(got, list) else type(got).__name__}")
        for pid, pair in enumerate(got):
            expected = list(grouped_pid_ref(pid, m, n, g))
            if not isinstance(pair, list) or pair != expected:
                shown = tuple(pair) if isinstance(pair, list) else type(pair).__name__
                return Verdict.failed(f"grouped_pid({pid}, num_pid_m={m}, num_pid_n={n}, group_m={g}) gave "
                                      f"{shown}, expected {tuple(expected)}")
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


def tuned_config(ns: dict) -> dict[str, int]:
    """The student's MATMUL_CONFIG (a literal the extraction kept), checked by the trusted launcher's rules."""
    if "MATMUL_CONFIG" not in ns:
        raise NameError("the tuning cell defines no MATMUL_CONFIG (a dict literal of launch options)")
    return check_config(ns["MATMUL_CONFIG"])


def speed_timed(ns: dict, inputs: dict):
    kernel = triton_kernel(ns, "matmul_kernel")
    config = tuned_config(ns)
    a, b = on_device(inputs["a"][0]), on_device(inputs["b"][0])
    return lambda: [_launch(a, b, kernel=kernel, **config)]


def speed_baseline(_ns: dict, inputs: dict):
    a, b = on_device(inputs["a"][0]), on_device(inputs["b"][0])
    return lambda: [torch.matmul(a, b)]


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return _matmul_check(inputs, [o.cpu() for o in outputs], params)


LAB = LabSpec(
    name="01_gemm",
    preamble="from fastdl_lab import device\nfrom fastdl_lab import gemm\n",
    items=[
        Item("row_sum", 2, ("row_sum_kernel_code",), row_sum_inputs, row_sum_drive, row_sum_check,
             kernels=("row_sum_kernel",), description="warm-up Triton kernel: masked, strided row sums, hidden ragged shapes"),
        Item("matmul_fp32", 4, ("matmul_kernel_code",), _matmul_inputs(torch.float32), matmul_drive, _matmul_check,
             kernels=("matmul_kernel",), description="Triton matmul, fp32, hidden ragged shapes"),
        Item("matmul_fp16", 2, ("matmul_kernel_code",), _matmul_inputs(torch.float16), matmul_drive, _matmul_check,
             kernels=("matmul_kernel",), description="Triton matmul, fp16 (low-precision rule)"),
        Item("grouped_order", 2, ("grouped_order_code",), grouped_inputs, grouped_drive, grouped_check,
             kind="mechanism", description="grouped program ordering"),
        Item("matmul_speed", 2, ("matmul_kernel_code", "matmul_tuning_code"), speed_inputs, kind="speed",
             check=speed_check, timed=speed_timed, baseline=speed_baseline, kernels=("matmul_kernel",),
             description="speed vs torch.matmul with the tuned MATMUL_CONFIG (GPU profiles)"),
    ],
)
