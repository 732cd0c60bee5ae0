"""The trusted grading engine: one submission of one lab in, one verdict per item out.

This process never imports or executes student code. Each item runs in a fresh sandboxed child
(``child.py``, isolated by ``bwrap.py``): a kernel item gets only the student's ``@triton.jit``
functions, extracted here by AST (``kernels.py``); a Python item gets its solution cells. Inputs
come from a secret seed per student; the item's ``check`` compares the child's outputs, delivered
once and announced with their digest (``delivery.py``), read back as capped regular files, with
references computed here; speed items are timed inside a kernel
child, where no student Python runs, by ``fastdl_lab.timing``.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch

import autograder
from autograder import notebook, profiles
from autograder.records import clean_reason
from autograder.engine import artefacts, bwrap, delivery, faults, kernels, prefork, speed
from autograder.engine.items import Item, LabSpec, Verdict
from autograder.engine.sandbox import ChildResult, Limits, run_sandboxed

NEEDS_GPU = "needs a GPU: speed is graded only on GPU profiles; left out of the total"
UNISOLATED = "UNSAFE, graded without isolation (--unsafe-no-isolation): "
OUTPUTS_CAP = 2 << 30
ERROR_CAP = 64 << 10
# Where the grader's driver code appears inside the sandbox.
GRADER_DIR = "/opt/fastdl/grader"
# Where the C++ builds' shared parts (fastdl_lab.custom.pch: the precompiled tensor header and the
# bindings' object) appear, read-only: the root of pch's folders, holding the one the grader made.
PCH_DIR = "/opt/fastdl/pch"


@dataclass
class ItemResult:
    item: str
    score: float
    max_score: float
    status: str  # passed | partial | failed | error | timeout | crashed | memory | output | tampered | ...
    reason: str
    counted: bool = True  # False: visibly left out of the total (needs a GPU on this profile)
    wall_s: float = 0.0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sandbox:
    """How children run: isolated (the default), or not at all when the instructor insists."""

    student_package: Path
    profile: dict
    isolated: bool = True
    scratch: Path | None = None  # where the children's work folders are made; None: the temporary directory


def _digest(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def student_seed(seed: int, lab: str, student: str) -> int:
    """Every student's hidden inputs differ; the batch seed regrades them all identically."""
    return _digest(seed, lab, student)


def item_seed(seed: int, item: str) -> int:
    return _digest(seed, item)


def _child_env(sandbox: Sandbox, workdir: str) -> dict[str, str]:
    if sandbox.isolated:
        where = {"home": bwrap.JOB, "PYTHONPATH": f"{bwrap.STUDENT_DIR}:{GRADER_DIR}"}
    else:
        where = {"home": workdir, "tmp": workdir,
                 "PYTHONPATH": f"{sandbox.student_package}:{Path(autograder.__file__).parent.parent}"}
    return bwrap.environment(gpu=bool(sandbox.profile.get("gpu")), PYTHONHASHSEED="0", MPLBACKEND="Agg",
                             OMP_NUM_THREADS=str(sandbox.profile.get("threads", 1)), **where)


class TooLarge(ValueError):
    """A file a child wrote that is larger than the parent reads."""


def read_regular(path: str, cap: int) -> bytes:
    """A file a child wrote, read without following links or blocking, at most ``cap`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > cap:
            raise TooLarge(f"larger than {cap >> 20} MiB")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(cap + 1)
    finally:
        os.close(fd)
    if len(data) > cap:
        raise TooLarge(f"larger than {cap >> 20} MiB")
    return data


def _triton_key() -> str:
    """The name Triton gives this installation (cached by Triton: hashed once per process)."""
    from triton.runtime.cache import triton_key

    return triton_key()


class Undelivered(Exception):
    """Outputs the parent will not grade: ``status`` and ``reason`` of the item's verdict."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def delivered_outputs(workdir: str, announced: list[str]):
    """The outputs the child's trusted code delivered in ``workdir`` with the digests ``announced``
    (``delivery.py``), or ``Undelivered``: not delivered, or too large, is ``failed``; changed or
    replaced after delivery, ``tampered``."""
    if not announced:
        raise Undelivered("failed", "the code exited before the grader's code could save the outputs "
                                    "(sys.exit or os._exit in a solution cell?)")
    try:
        data = read_regular(os.path.join(workdir, delivery.OUTPUTS), OUTPUTS_CAP)
    except FileNotFoundError:
        raise Undelivered("failed", "the outputs the grader's code saved were removed") from None
    except TooLarge as exc:
        raise Undelivered("failed", f"the outputs are {exc}") from None
    except (OSError, ValueError) as exc:
        raise Undelivered("tampered", f"the outputs the grader's code saved were replaced: {exc}") from None
    problem = delivery.problem(announced, data)
    if problem:
        raise Undelivered("tampered", problem)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - outputs of a student's types may fail to load in many ways
        raise Undelivered("failed", f"outputs could not be read: {type(exc).__name__}: {exc}") from None


class _Workdir:
    """A private directory, owned by the sandboxed uid, holding one child's job and results."""

    def __init__(self, lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, *, mode: str,
                 params: dict, within: Path | None = None):
        # Only the jit functions, screened classes and functions, and constants of an extracted
        # item's cells reach the child; a rejected one raises here, before anything is made.
        sources = [cells[c] for c in item.cells]
        kernel_source = kernels.extract(sources, item.kernels) if item.kernels else None
        artefact_source = artefacts.extract(sources, item.artefacts, item.library) if item.artefacts else None
        self.path = tempfile.mkdtemp(prefix=f"fastdl-{item.name}-", dir=within)
        self.job = {"lab": lab.name, "item": item.name, "preamble": lab.preamble, "cells": [], "mode": mode,
                    "params": params, "instruments": list(item.instruments)}
        if kernel_source is not None:
            Path(self.path, "kernels.py").write_text(kernel_source)
            self.job.update(kernel_module="kernels.py", triton_key=_triton_key())
        if artefact_source is not None:
            Path(self.path, "artefacts.py").write_text(artefact_source)
            self.job.update(artefact_module="artefacts.py", scope=item.scope,
                            instruments=[*self.job["instruments"], *artefacts.GRAD_DESCRIPTORS])
        if kernel_source is None and artefact_source is None:
            for i, cell_id in enumerate(item.cells):
                name = f"cell_{i}_{cell_id}.py"
                Path(self.path, name).write_text(cells[cell_id])
                self.job["cells"].append({"id": cell_id, "file": name})
        Path(self.path, "job.json").write_text(json.dumps(self.job))
        torch.save(inputs, os.path.join(self.path, "inputs.pt"))
        bwrap.prepare_workdir(self.path)

    def error(self) -> tuple[str, str] | None:
        """(status, message) the child reported, or None."""
        path = os.path.join(self.path, "error.json")
        if not os.path.lexists(path):
            return None
        try:
            report = json.loads(read_regular(path, ERROR_CAP))
            status = report.get("status", "error")
            known = ("error", "tampered", "not_a_kernel", faults.MACHINE)
            return (status if status in known else "error"), str(report["error"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return "error", "the child reported an error it could not describe"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _precompiled_headers() -> Path | None:
    """The C++ builds' shared folder (``pch``), made on first use; None where it cannot be made
    (the build then makes both parts itself, and a missing compiler is the build's named error)."""
    from fastdl_lab.custom import pch, sources

    try:
        return pch.ensure(sources.OPTIMISE)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def _item_env(sandbox: Sandbox, workdir: str, headers: Path | None) -> dict[str, str]:
    env = _child_env(sandbox, workdir)
    if headers is not None:
        from fastdl_lab.custom.pch import ENV_VAR

        env[ENV_VAR] = str(headers.parent) if not sandbox.isolated else PCH_DIR
    return env


def start_fork_servers(lab: LabSpec, profile: dict) -> None:
    """Start now, not at the first item, the fork servers (``prefork.py``) this grading process's
    sandboxed children of ``lab`` will be forked from: a process pays their start once."""
    sandbox = Sandbox(Path(), profile)
    variants = {None} | ({_precompiled_headers()} if any(item.torch_headers for item in lab.items) else set())
    for headers in variants:
        prefork.server_for(_item_env(sandbox, bwrap.JOB, headers), gpu=bool(profile.get("gpu")))


def _run_child(work: _Workdir, limits: Limits, sandbox: Sandbox, headers: Path | None = None) -> ChildResult:
    env = _item_env(sandbox, work.path, headers)
    # The outputs' announcement (delivery.py) and, in mode "speed", the timed phase's markers.
    mark = delivery.PREFIX
    if not sandbox.isolated:
        argv = [sys.executable, "-m", "autograder.engine.child", work.path]
        return run_sandboxed(argv, limits=limits, cwd=work.path, env=env, mark=mark)
    read_only = {str(sandbox.student_package): bwrap.STUDENT_DIR,
                 str(Path(autograder.__file__).parent): f"{GRADER_DIR}/autograder"}
    if headers is not None:
        read_only[str(headers)] = f"{PCH_DIR}/{headers.name}"
    view = bwrap.View(work.path, read_only=read_only, gpu=bool(sandbox.profile.get("gpu")))
    argv = [bwrap.PYTHON, "-m", "autograder.engine.child", bwrap.JOB]
    return run_sandboxed(argv, limits=limits, cwd=work.path, env=env, view=view, mark=mark,
                         server=prefork.server_for(env, gpu=view.gpu))


def _failure(item: Item, result: ChildResult, work: _Workdir) -> ItemResult:
    reported = work.error() if result.status == "error" else None
    fault = faults.machine_fault(reported, result.output_tail) if result.status == "error" else None
    if fault:
        return ItemResult(item.name, 0.0, item.points, faults.NOT_GRADED, clean_reason(fault))
    if reported:
        status, message = reported
        if status == "error":
            message = f"your code raised {message}"
        return ItemResult(item.name, 0.0, item.points, status, clean_reason(message))
    reason = result.reason
    if result.status == "error":
        reason = f"{result.reason}: {result.output_tail[-200:].strip()}"
    return ItemResult(item.name, 0.0, item.points, result.status, clean_reason(reason),
                      details={"output_tail": result.output_tail[-1000:]})


def _judge(item: Item, inputs: dict, outputs, params: dict) -> Verdict:
    try:
        return item.check(inputs, outputs, params)
    except Exception as exc:  # noqa: BLE001 - outputs of the wrong type or shape end here
        return Verdict.failed(f"outputs have the wrong form: {type(exc).__name__}: {exc}")


def _from_verdict(item: Item, verdict: Verdict, wall_s: float) -> ItemResult:
    fraction = min(1.0, max(0.0, float(verdict.fraction)))
    status = "passed" if fraction == 1.0 else "partial" if fraction > 0 else "failed"
    return ItemResult(item.name, round(item.points * fraction, 4), item.points, status, clean_reason(verdict.reason),
                      True, wall_s, verdict.details)


def _item_limits(item: Item, profile: dict) -> Limits:
    limits = profiles.limits(profile)
    limits.loopback = item.loopback
    limits.max_processes += item.processes
    # Every rank imports torch: resident memory grows with the world.
    limits.memory_bytes += item.processes * (1 << 30)
    limits.wall_s += item.build_s
    limits.cpu_s += 2 * item.build_s
    return limits


def _grade_item(lab: LabSpec, item: Item, cells: dict[str, str], seed: int, sandbox: Sandbox) -> ItemResult:
    params = profiles.item_params(sandbox.profile, lab.name, item.name)
    inputs = item.make_inputs(item_seed(seed, item.name), params)
    mode = "speed" if item.is_speed else "check"
    if mode == "speed":
        params = {**params, "order_seed": item_seed(seed, "order") % (1 << 31)}
    try:
        work = _Workdir(lab, item, cells, inputs, mode=mode, params=params, within=sandbox.scratch)
    except kernels.KernelRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "not_a_kernel", clean_reason(str(exc)))
    except artefacts.ArtefactRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    try:
        headers = _precompiled_headers() if item.torch_headers else None
        result = _run_child(work, _item_limits(item, sandbox.profile), sandbox, headers)
        if not result.ok:
            return _failure(item, result, work)
        try:
            outputs = delivered_outputs(work.path, delivery.digests(result.marks))
        except Undelivered as exc:
            return ItemResult(item.name, 0.0, item.points, exc.status, clean_reason(exc.reason), wall_s=result.wall_s)
        if mode == "check":
            return _from_verdict(item, _judge(item, inputs, outputs, params), result.wall_s)
        return _speed_result(item, inputs, outputs, params, sandbox.profile, speed.timing_marks(result.marks))
    finally:
        work.remove()


def _speed_result(item: Item, inputs: dict, timed: dict, params: dict, profile: dict,
                  marks: list[tuple[str, float]]) -> ItemResult:
    try:
        samples = {role: [float(s) for s in timed[f"{role}_s"]] for role in speed.ROLES}
        batches = {role: timed[f"{role}_batch"] for role in speed.ROLES}
        outputs = timed["outputs"]
        if not all(samples.values()) or min(samples["candidate"] + samples["baseline"]) <= 0:
            raise ValueError("no positive timings (a call that launches nothing takes no time)")
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        return ItemResult(item.name, 0.0, item.points, "failed", clean_reason(f"timings could not be read: {exc}"))
    details = {f"{role}_s": samples[role] for role in speed.ROLES}
    wall_s, protocol = speed.phase_wall(marks)
    problem = protocol or speed.cross_check(samples, batches, wall_s,
                                            reps=int(params.get("reps", speed.DEFAULT_REPS)))
    if problem:
        return ItemResult(item.name, 0.0, item.points, "tampered", clean_reason(f"timings refused: {problem}"),
                          details={**details, "phase_wall_s": wall_s})
    verdict = _judge(item, inputs, outputs, params)
    if verdict.fraction < 1:
        return ItemResult(item.name, 0.0, item.points, "failed", clean_reason(f"timed output is wrong: {verdict.reason}"),
                          details=details)
    speedup = median(samples["baseline"]) / median(samples["candidate"])
    target = float(params.get("min_speedup", 1.0))
    passed = speedup >= target
    reason = f"speedup {speedup:.2f}x over the baseline (needs {target:.2f}x on the {profile['name']} profile)"
    return ItemResult(item.name, item.points if passed else 0.0, item.points, "passed" if passed else "failed",
                      reason, details={**details, "speedup": speedup, "phase_wall_s": wall_s})


def run_items(items: list[Item], grade_one, parallel: int, alongside=None) -> list[ItemResult]:
    """``grade_one`` every item, in the order given: all but the speed items ``parallel`` at a
    time, then each speed item alone, once every other item's child has ended, so nothing shares
    the GPU (or the cores, or the memory bus) with the code being timed.

    ``alongside``, a callable (nbgrader's run of the notebook), takes one of the ``parallel``
    slots beside the items, and also ends before the first speed item starts; what it raises is
    raised here, after every item's child has ended."""
    from concurrent.futures import ThreadPoolExecutor

    shared = [i for i, item in enumerate(items) if not item.is_speed]
    alone = [i for i, item in enumerate(items) if item.is_speed]
    results: dict[int, ItemResult] = {}
    # Leaving the with-block waits for every shared item: no child of theirs outlives it.
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        beside = pool.submit(alongside) if alongside is not None else None
        results.update(zip(shared, pool.map(grade_one, [items[i] for i in shared])))
    if beside is not None:
        beside.result()
    for i in alone:
        results[i] = grade_one(items[i])
    return [results[i] for i in range(len(items))]


def grade_submission(
    lab: LabSpec, path: Path, *, release: Path, profile: dict, seed: int, student_package: Path, parallel: int = 2,
    isolated: bool = True, only: set[str] | None = None, alongside=None, scratch: Path | None = None,
) -> list[ItemResult]:
    """Grade every item of ``lab`` (or those named in ``only``) in the notebook at ``path``; never
    raises for the student's doing. ``alongside`` runs once, as ``run_items`` says. The children's
    work folders are made in ``scratch`` (the job's folder), else in the temporary directory."""
    items = [it for it in lab.items if only is None or it.name in only]
    try:
        submitted = notebook.graded_cells(notebook.read_notebook(path))
    except notebook.NotebookError as exc:
        if alongside is not None:
            alongside()
        return [ItemResult(it.name, 0.0, it.points, "needs_gpu", NEEDS_GPU, counted=False)
                if notebook.needs_gpu(it, profile) else
                ItemResult(it.name, 0.0, it.points, "invalid_notebook", clean_reason(exc)) for it in items]
    released = notebook.graded_cells(notebook.read_notebook(release))
    sandbox = Sandbox(Path(student_package), profile, isolated, scratch)

    def grade_one(item: Item) -> ItemResult:
        result = _grade_one(item)
        if not isolated:
            result.reason = UNISOLATED + result.reason
        return result

    def _grade_one(item: Item) -> ItemResult:
        started = time.monotonic()
        if notebook.needs_gpu(item, profile):
            return ItemResult(item.name, 0.0, item.points, "needs_gpu", NEEDS_GPU, counted=False)
        problem = notebook.test_cell_problem(item.name, submitted, released, item.cells)
        if problem:
            return ItemResult(item.name, 0.0, item.points, "tampered", clean_reason(problem))
        problem = notebook.solution_problem(item.cells, submitted, released)
        if problem:
            status = "unanswered" if problem.startswith("not attempted") else "missing"
            return ItemResult(item.name, 0.0, item.points, status, problem)
        result = _grade_item(lab, item, submitted.solutions, seed, sandbox)
        result.wall_s = round(time.monotonic() - started, 3)
        return result

    return run_items(items, grade_one, parallel, alongside)
