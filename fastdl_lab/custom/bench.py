"""Benchmark spec and self-check of lab 09's custom LLTM cell; ``benchmarks/custom.py`` runs them.

The timing table of the C++/CUDA extension story at its shape (batch 16, 32 input features, 128
state): forward and backward of the autograd reference, the hand-written Python ops, the C++
extension and the C++ extension called through the ``torch.library`` op, each against the Python
ops, A/B interleaved. On a GPU host the same on CUDA tensors plus the fused CUDA kernels; here
those rows need a GPU and are not written. Also recorded: the cold build time of the C++
extension and nvcc's time to compile the CUDA source to PTX for sm_80 and sm_90.

Every compiled backend is checked against ``lltm_ref`` before it is timed.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastdl_lab import device
from fastdl_lab.custom import library, sources
from fastdl_lab.custom.lltm import PYTHON_OPS, LLTMOps, check_ops, lltm_cell, lltm_ref, make_inputs, ops_of

BENCHMARK = {
    "name": "custom",
    "shape": {"batch": 16, "input_features": 32, "state_size": 128},
    "dtype": torch.float32,
    "passes": ["forward", "backward"],
    "implementations": ["autograd", "python", "cpp", "library+cpp", "cuda"],
    "capabilities": [80, 90],
    # One intra-op thread on the CPU: at this size a second thread saves nothing, and on a shared
    # machine a busy core stalls every parallel region of a two-thread op for a scheduler slice.
    "cpu_threads": 1,
    "gpu_only": ["cuda"],
}

_COLUMNS = ("op", "implementation", "device", "threads", "dtype", "batch", "input_features", "state_size", "median_s",
            "iqr_s", "speedup_vs_python", "ci_low", "ci_high")


def _row(**values) -> dict:
    # One fixed set of columns, so every run appends to the same CSV.
    return {name: values.get(name) for name in _COLUMNS}


def _cell(implementation: str, ops: dict[str, LLTMOps]) -> Callable:
    if implementation == "autograd":
        return lltm_ref
    if implementation == "library+cpp":
        return library.lltm_op
    chosen = ops[implementation]
    return lambda *args: lltm_cell(*args, ops=chosen)


def _pass_fn(cell: Callable, inputs: list, which: str) -> Callable:
    """forward: what a training step pays (the graph is recorded); backward: that graph, re-run."""
    if which == "forward":
        return lambda: cell(*inputs)
    outputs = cell(*inputs)
    grads = [torch.ones_like(t) for t in outputs]
    # retain_graph lets one forward's graph be differentiated on every call; grad() does not
    # accumulate into .grad, so each call does the same work.
    return lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)


def _time_rows(ops: dict[str, LLTMOps], dev: str, reps: int, log) -> list[dict]:
    from fastdl_lab import timing

    shape, dtype = BENCHMARK["shape"], BENCHMARK["dtype"]
    inputs = make_inputs(**shape, dtype=dtype, seed=0, device=dev, requires_grad=True)
    available = {"autograd", *ops, *(["library+cpp"] if "cpp" in ops else [])}
    names = [n for n in BENCHMARK["implementations"] if n in available]
    threads = BENCHMARK["cpu_threads"] if dev == "cpu" else None
    rows = []
    for which in BENCHMARK["passes"]:
        baseline = _pass_fn(_cell("python", ops), inputs, which)
        for name in names:
            # The registered op runs whatever backend is installed: the C++ build, for its
            # forward and for the backward that the recorded graph calls later.
            installed = library.using_ops(ops["cpp"], dev) if name == "library+cpp" else contextlib.nullcontext()
            with installed:
                fn = _pass_fn(_cell(name, ops), inputs, which)
                if name == "python":
                    t, cmp = timing.bench(fn, reps=reps, threads=threads), None
                else:
                    cmp = timing.compare(fn, baseline, reps=reps, threads=threads)
                    t = cmp.candidate
            rows.append(_row(op=which, implementation=name, device=dev, threads=threads,
                             dtype=str(dtype).replace("torch.", ""), **shape, median_s=t.median, iqr_s=t.iqr,
                             speedup_vs_python=cmp.speedup if cmp else 1.0,
                             ci_low=cmp.ci_low if cmp else None, ci_high=cmp.ci_high if cmp else None))
            log(f"{dev:>4} {which:>8} {name:>12}: {t.median * 1e6:8.1f} us"
                + (f"  {cmp.speedup:5.2f}x python (95% CI {cmp.ci_low:.2f}-{cmp.ci_high:.2f})" if cmp else ""))
    return rows


def _build_rows(folder: Path, log) -> tuple[list[dict], LLTMOps]:
    start = time.perf_counter()
    module = sources.build_cpp(name="fastdl_lltm_bench", build_dir=folder / "cpp")
    seconds = time.perf_counter() - start
    log(f"C++ extension, cold build into an empty folder: {seconds:.1f} s")
    rows = [_row(op="build", implementation="cpp", device="cpu", median_s=seconds)]
    for capability in BENCHMARK["capabilities"]:
        if sources.find_nvcc() is None:
            log(f"nvcc sm_{capability}: no nvcc on this machine")
            continue
        start = time.perf_counter()
        sources.compile_cuda(capability)
        seconds = time.perf_counter() - start
        log(f"CUDA source to PTX, sm_{capability} ({sources.nvcc_version()}): {seconds:.1f} s")
        rows.append(_row(op="nvcc_ptx", implementation=f"sm_{capability}", device="cpu", median_s=seconds))
    return rows, ops_of(module, "cpp")


def benchmark(reps: int = 20, log: Callable[[str], None] = print) -> list[dict]:
    """Every measurement this machine can make; one dict per row of ``benchmarks/results/custom.csv``."""
    shape = BENCHMARK["shape"]
    with tempfile.TemporaryDirectory(prefix="fastdl-custom-") as tmp:
        rows, cpp = _build_rows(Path(tmp), log)
        devices = {"cpu": {"python": PYTHON_OPS, "cpp": cpp}}
        if device.has_gpu():
            cuda = ops_of(sources.build_cuda(name="fastdl_lltm_bench_cuda", build_dir=Path(tmp) / "cuda"), "cuda")
            # On CUDA tensors the C++ ops launch ATen's CUDA kernels, one per operator.
            devices["cuda"] = {"python": PYTHON_OPS, "cpp": cpp, "cuda": cuda}
        for dev, ops in devices.items():
            for name, backend in ops.items():
                # Validated before timed: float64 at an irregular shape, then the timed shape.
                check_ops(backend, make_inputs(5, 3, 7, dtype=torch.float64, seed=1, device=dev))
                check_ops(backend, make_inputs(**shape, dtype=BENCHMARK["dtype"], seed=2, device=dev))
            rows += _time_rows(ops, dev, reps, log)
    if not device.has_gpu():
        log(f"{', '.join(BENCHMARK['gpu_only'])}: needs a GPU (compiled to PTX above, not run)")
    return rows


def check() -> None:
    """The Python ops and the registered op against the reference, and the compiler-error reader."""
    for dtype in (torch.float64, torch.float32):
        check_ops(PYTHON_OPS, make_inputs(5, 3, 7, dtype=dtype, seed=3))
    inputs = make_inputs(4, 6, 5, dtype=torch.float64, seed=4)
    for a, e in zip(library.lltm_op(*inputs), lltm_ref(*inputs)):
        torch.testing.assert_close(a, e)
    line = sources.first_compiler_error("FAILED: main.o\n/tmp/x/main.cpp:3:1: error: 'foo' does not name a type\n")
    assert line == "main.cpp:3:1: error: 'foo' does not name a type", line
    print(f"custom: checks passed (nvcc: {sources.nvcc_version() or 'none'})")
