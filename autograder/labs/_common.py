"""Pieces the lab specs share: finding the student's kernel, devices, per-case partial credit."""

from __future__ import annotations

import torch

from autograder.engine.items import Verdict


# What a saved-bytes figure measured in the student's process rests on: bound before the cells
# run, verified unchanged after them (``Item.instruments``).
SAVED_TENSOR_INSTRUMENTS = (
    "fastdl_lab.memory.saved_tensor_bytes", "fastdl_lab.memory._saved_storages", "fastdl_lab.memory._storage_key",
    "fastdl_lab.memory._ctx_tensors", "fastdl_lab.memory._held",
    "torch.autograd.graph.saved_tensors_hooks.__init__", "torch.autograd.graph.saved_tensors_hooks.__enter__",
    "torch.autograd.graph.saved_tensors_hooks.__exit__", "torch._C._autograd._push_saved_tensors_default_hooks",
    "torch.Tensor.untyped_storage", "torch.save",
)


def triton_kernel(ns: dict, name: str):
    """The student's ``@triton.jit`` function ``name``, refusing anything that is not a kernel."""
    kernel = ns.get(name)
    if kernel is None:
        raise NameError(f"the solution cell does not define {name}")
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    # Exactly Triton's own kernel types: anything launchable as kernel[grid] could otherwise hide
    # a library call behind a kernel's name.
    if type(kernel) not in (JITFunction, InterpretedFunction):
        raise TypeError(f"{name} must be a @triton.jit kernel, not {type(kernel).__name__}")
    return kernel


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if torch.cuda.is_available() else t


def require_tensor(value, name: str) -> None:
    """Outputs come from an untrusted process: anything but a tensor fails with its type named."""
    if not isinstance(value, torch.Tensor):
        raise AssertionError(f"{name}: expected a tensor, got {type(value).__name__}")


def failure_text(exc: AssertionError) -> str:
    report = getattr(exc, "report", None) or str(exc)
    return report.strip()[:600]


def per_case(labels: list[str], check_one) -> Verdict:
    """Run ``check_one(i)`` for every case; the fraction passed is the credit."""
    failures = []
    for i, label in enumerate(labels):
        try:
            check_one(i)
        except AssertionError as exc:
            message = failure_text(exc)
            failures.append(message if label in message else f"{label}: {message}")
    passed = len(labels) - len(failures)
    if not failures:
        return Verdict.passed(f"correct on all {len(labels)} hidden cases: {', '.join(labels)}")
    return Verdict(passed / len(labels), f"{passed}/{len(labels)} hidden cases correct; first failure: {failures[0]}")


def clocked_speed(observed, params: dict, differs, what: str, against: str) -> Verdict:
    """The verdict of a speed item timed on the grader's clock (``items.Clocked``): every timed
    call's output is first checked against the baseline's output of the same call
    (``differs(got, want, i) -> str | None`` says how it differs), so that a call answered from a
    cache, or from an earlier call's answer, fails; then the median speedup of ``what`` over the
    baseline (``against`` says what that is) meets the profile's ``min_speedup`` or not."""
    from statistics import median

    timings = observed.timings
    candidate, baseline = timings.get("candidate") or [], timings.get("baseline") or []
    if not candidate or len(candidate) != len(baseline):
        return Verdict.failed("no timed call came back")
    for i, (got, want) in enumerate(zip(candidate, baseline)):
        problem = differs(got, want, i)
        if problem:
            return Verdict.failed(f"timed call {i}: {what} {problem}, against the baseline's answer to the same call")
    speedup = median(timings["baseline_s"]) / median(timings["candidate_s"])
    target = float(params.get("min_speedup", 1.0))
    details = {"speedup": speedup, "candidate_s": list(timings["candidate_s"]),
               "baseline_s": list(timings["baseline_s"])}
    clock = (f"{what}: {speedup:.2f}x over {against}, median of {len(candidate)} calls each on the grader's clock, "
             "each call's inputs new to it")
    if speedup < target:
        return Verdict(0.0, f"right answers, but {clock} (needs {target:.2f}x)", details)
    return Verdict.passed(f"{clock} (needs {target:.2f}x)", **details)
