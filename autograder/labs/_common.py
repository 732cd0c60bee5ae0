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
