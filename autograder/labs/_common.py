"""Pieces the lab specs share: finding the student's kernel, devices, per-case partial credit, and the
memory peak a mechanism item is judged on."""

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


# --- memory peaks measured outside the child ------------------------------------------------

# How far above the course's implementation the student's peak may go, unless the profile says.
PEAK_MARGIN_MB = 64
SAMPLED_NOTE = "sampled every 0.05 s, no memory cgroup here: a shorter spike is not seen"


def exact_peaks(threshold: int | None = None) -> None:
    """Make this process's memory peak follow what it holds, not what the allocator kept, as lab
    07's ranks do (``engine/child.py``): blocks from ``threshold`` bytes (64 KiB by default) are
    mapped when allocated and unmapped when freed.

    By default glibc raises its mmap threshold to the size of the largest block freed so far (up to
    32 MiB): from then on tensors of a few MiB come from the heap, and when freed they stay
    resident in holes that blocks allocated in between keep from being reused or returned. The
    peak then depends on the order of allocations as much as on their sizes: a chain of Conv -> BN
    layers of 16 MiB measured 483 MiB, the same chain with recompute 755 MiB; FlashAttention in
    PyTorch at N = 8192, its 2 MiB tiles from the heap and the child's footprint count beside
    them, 870-910 MiB against 80 MiB with every tile mapped. Mapped, the peak repeats to a MiB or
    so. The price is a page fault per 4 KiB of every new block, about as much time again as
    elementwise work: an item whose transient blocks are many and small next to what it must see
    (the interpreter's tiles beside an N x N matrix) passes a higher ``threshold``. Called by a
    memory item's drive before its calls, in the student's child and the reference child alike.
    """
    from autograder.engine.child import MMAP_THRESHOLD_BYTES, _memory_returned_on_free

    _memory_returned_on_free(MMAP_THRESHOLD_BYTES if threshold is None else threshold)


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def peak_verdict(observed, params: dict, what: str, wrong: str) -> tuple[bool, str, dict]:
    """(passed, reason, figures): the student's child's memory peak against the reference child's.

    Both children ran the same driver on inputs of the same sizes, in the same sandbox and limits;
    only the implementation differs (the student's, the course's). ``observed.peak_bytes`` is the
    kernel's count for the child's cgroup (every thread and process of it, and its tmpfs files),
    which nothing in the child can lower. The student's may exceed the course's by the profile's
    ``peak_margin_mb``; ``what`` names the graded call ("at N=8192"), ``wrong`` says what the
    wrong mechanism costs there (the margin is a fraction of it)."""
    reference = observed.reference or {}
    mine, theirs = int(observed.peak_bytes or 0), int(reference.get("peak_bytes") or 0)
    margin = int(float(params.get("peak_margin_mb", PEAK_MARGIN_MB)) * 2**20)
    excess = mine - theirs
    figures = {"peak_bytes": mine, "reference_peak_bytes": theirs, "peak_excess_bytes": excess,
               "peak_margin_bytes": margin, "peak_source": observed.peak_source,
               "reference_peak_source": reference.get("peak_source")}
    if not mine or not theirs:
        return False, f"the memory of {what} could not be measured: no peak was recorded", figures
    note = ""
    if observed.peak_source != "cgroup" or reference.get("peak_source") != "cgroup":
        note = f" ({SAMPLED_NOTE})"
    if excess > margin:
        return False, (f"peak {mib(excess)} above the course's implementation {what} (allowed {mib(margin)}; "
                       f"{wrong}){note}"), figures
    return True, (f"peak {mib(abs(excess))} {'above' if excess >= 0 else 'below'} the course's implementation "
                  f"{what} (allowed {mib(margin)} above){note}"), figures
