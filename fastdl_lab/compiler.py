"""What a compiler sees of a Python function, and what it can do about overhead (lab 02 fusion).

``torch.compile`` reads Python bytecode (Dynamo) and builds graphs of tensor operations; where it
meets something a graph cannot hold, such as a branch on a tensor's values, it ends the graph,
runs that bit in Python and starts another (a *graph break*). It also guards every graph on what
it assumed (shapes, dtypes, the values of Python numbers) and compiles again when a guard fails
(a *recompile*). TorchScript, the older route, either records one run (``torch.jit.trace``) or
compiles the source (``torch.jit.script``), and the two disagree on branches.

- ``data_dependent``: a function whose branch depends on a tensor's values;
- ``graph_breaks``: ``torch._dynamo.explain`` reduced to graphs, breaks and where each break is;
- ``torch_logs``: a script run in a fresh interpreter with ``TORCH_LOGS`` set, its log messages back;
- ``trace_vs_script``: one branchy function traced on one input and scripted, both run on another;
- ``tiny_layers`` and ``reduce_overhead_timings``: an overhead-bound stack of small layers, eager,
  compiled, and compiled with ``mode="reduce-overhead"`` (CUDA graphs: a GPU only).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable

import torch

from fastdl_lab import device


def data_dependent(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    """``cos`` of ``sin(x) * scale`` where that sums to more than 0, ``exp`` of it elsewhere: which
    branch runs is known only once the tensor's values are."""
    y = torch.sin(x) * scale
    if y.sum() > 0:
        return y.cos()
    return y.exp()


@dataclasses.dataclass(frozen=True)
class Breaks:
    graphs: int
    breaks: int
    reasons: list[str]  # one per break: Dynamo's reason, and where in the user's code


def graph_breaks(fn: Callable, *args, **kwargs) -> Breaks:
    """How Dynamo splits ``fn`` on these arguments: graphs, graph breaks, and each break's reason
    with the file, line and source line that caused it. Compiles nothing (Dynamo only)."""
    import linecache

    import torch._dynamo

    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = []
    for reason in explained.break_reasons:
        where = ""
        if reason.user_stack:
            frame = reason.user_stack[-1]
            line = linecache.getline(frame.filename, frame.lineno).strip()
            where = f" at {os.path.basename(frame.filename)}:{frame.lineno} `{line}`"
        reasons.append(f"{reason.reason}{where}")
    return Breaks(explained.graph_count, explained.graph_break_count, reasons)


# The child script of ``torch_logs`` for the lab: one graph break, then two recompiles (a new value
# of a Python float, a new dtype). The eager backend: Dynamo's work is what the logs are about.
LOG_DEMO = """
import torch
from fastdl_lab.compiler import data_dependent

f = torch.compile(data_dependent, backend="eager")
x = torch.randn(8)
f(x, 2.0)
f(x, 3.0)
f(x.double(), 3.0)
"""

# "V1128 17:46:29.052000 11448 torch/_dynamo/x.py:5124] [0/0] [__graph_breaks] message": keep from
# the frame id on, which says which compiled frame ([0/1]: frame 0, its second compile) spoke.
_LOG_PREFIX = re.compile(r"^[A-Z]\d{4} [\d:.]+ +\d+ [^\]]+\] ")


def torch_logs(source: str = LOG_DEMO, logs: str = "graph_breaks,recompiles", timeout: float = 300) -> list[str]:
    """Run ``source`` in a fresh Python with ``TORCH_LOGS=logs``; return its log messages, without
    the timestamp and file prefix. A fresh process because the setting is read when torch starts."""
    env = {**os.environ, "TORCH_LOGS": logs}
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the script failed ({done.returncode}): {done.stderr[-2000:]}")
    return [_LOG_PREFIX.sub("", line) for line in done.stderr.splitlines() if _LOG_PREFIX.match(line)]


def sign_scale(x: torch.Tensor) -> torch.Tensor:
    """``2x`` if the elements sum to more than 0, else ``-x``: one branch on the data."""
    if x.sum() > 0:
        return x * 2
    return -x


def trace_vs_script(fn: Callable = sign_scale, example: torch.Tensor | None = None,
                    other: torch.Tensor | None = None) -> dict:
    """Trace ``fn`` on ``example`` and script it; run both and ``fn`` itself on ``other``.

    Returns the three outputs, the traced and scripted code, and the warnings each step raised.
    By default ``example`` takes the positive branch and ``other`` the negative one.
    """
    example = torch.ones(4) if example is None else example
    other = -torch.arange(1.0, 5.0) if other is None else other
    caught = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        traced = torch.jit.trace(fn, example)
    caught["trace"] = sorted({str(w.message) for w in seen})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scripted = torch.jit.script(fn)
    caught["script"] = sorted({str(w.message) for w in seen})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outputs = {"eager": fn(other), "traced": traced(other), "scripted": scripted(other)}
    caught["calls"] = sorted({str(w.message) for w in seen})
    return {"outputs": outputs, "traced_code": traced.code, "scripted_code": scripted.code, "warnings": caught}


def tiny_layers(depth: int = 32, width: int = 64, batch: int = 8, dev: str = "cpu",
                seed: int = 0) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """A stack of ``depth`` small linear + ReLU layers and an input: tens of small kernels per call,
    each too short to hide its launch, so the host sets the pace (lab 02's overhead regime)."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(width, width, generator=g) / width**0.5).to(dev) for _ in range(depth)]
    x = torch.randn(batch, width, generator=g).to(dev)

    def run(h: torch.Tensor) -> torch.Tensor:
        for w in weights:
            h = torch.relu(h @ w)
        return h

    return run, x


def reduce_overhead_timings(depth: int = 32, width: int = 64, batch: int = 8, reps: int = 50) -> dict:
    """Eager, ``torch.compile`` and ``torch.compile(mode="reduce-overhead")`` on ``tiny_layers``,
    timed by the course's harness on a GPU. ``reduce-overhead`` records the whole call as a CUDA
    graph and replays it with one launch; without a GPU there is nothing to record."""
    if not device.has_gpu():
        raise RuntimeError("needs a GPU: mode='reduce-overhead' replays CUDA graphs")
    from fastdl_lab import checks, timing

    run, x = tiny_layers(depth, width, batch, "cuda")
    variants = {"eager": run, "compiled": torch.compile(run), "reduce-overhead": torch.compile(run, mode="reduce-overhead")}
    with torch.no_grad():
        expected = run(x)
        for name, fn in variants.items():
            # The first calls compile, and for CUDA graphs warm up and record: keep them off the clock.
            for _ in range(3):
                out = fn(x)
            checks.assert_close(out.clone(), expected, atol=1e-4, rtol=1e-4, name=name)
        return {name: timing.bench(lambda fn=fn: fn(x), warmup=5, reps=reps) for name, fn in variants.items()}
