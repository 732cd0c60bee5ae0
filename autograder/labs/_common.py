"""Pieces the lab specs share: finding the student's kernel, devices, per-case partial credit."""

from __future__ import annotations

import torch

from autograder.engine.items import Verdict


def triton_kernel(ns: dict, name: str):
    """The student's ``@triton.jit`` function ``name``, refusing anything that is not a kernel."""
    kernel = ns.get(name)
    if kernel is None:
        raise NameError(f"the solution cell does not define {name}")
    # A Triton kernel (JITFunction, or InterpretedFunction under the interpreter) is launched as
    # kernel[grid]; a plain function here would mean the library is called instead of a kernel.
    if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "fn"):
        raise TypeError(f"{name} must be a @triton.jit kernel")
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
