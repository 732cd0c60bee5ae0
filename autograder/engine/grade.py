"""The trusted grading engine: one submission of one lab in, one verdict per item out.

This process never imports or executes student code. Each item runs in a fresh sandboxed child
(``child.py``, isolated by ``bwrap.py``): a kernel item gets only the student's ``@triton.jit``
functions, extracted here by AST (``kernels.py``); an artefact item the screened classes and
functions (``artefacts.py``); a Python item its solution cells; a built item (``Item.built``: lab
09's C++) the grader's copy of what a build child, which runs no code it builds, compiled from the
source and the item's screen approved here. Inputs come from a secret seed per
student and attempt, less what the item withholds, in the data-only format (``autograder.wire``);
the child's outputs come back over its channel (``channel.py``) in the same format, and the item's
``check`` compares them with references computed here. An item graded as worlds of ranks
(``Item.worlds``, lab 07) gets one such child per rank, joined by the grader's relay
(``worlds.py``). What an item measures about the child is
measured from outside it: the memory peak of its cgroup (``jail.py``), this process's clock on
each call (``Clocked`` items), the record of the services it called, a reference child's figures.
Only kernel items, where no student Python runs, are timed inside the child (``speed.py``); the
engine refuses a speed item of student Python that is not clocked (``ConfigurationError``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import median

import autograder
from autograder import notebook, profiles, wire
from autograder.records import clean_reason
from autograder.engine import artefacts, bwrap, channel, faults, kernels, prefork, speed
from autograder.engine.items import BuildRefused, Clocked, Item, LabSpec, Observed, Verdict
from autograder.engine.sandbox import ChildResult, Limits, run_sandboxed

NEEDS_GPU = "needs a GPU: speed is graded only on GPU profiles; left out of the total"
UNISOLATED = "UNSAFE, graded without isolation (--unsafe-no-isolation): "
# The grader's files for a child, read-only inside its /job (a capped tmpfs: ``bwrap.View``).
JOB_IN = f"{bwrap.JOB}/in"
INPUTS = "inputs.wire"
# Where the grader's driver code appears inside the sandbox.
GRADER_DIR = "/opt/fastdl/grader"
# Where the C++ builds' shared parts (fastdl_lab.custom.pch: the precompiled tensor header and the
# bindings' object) appear, read-only: the root of pch's folders, holding the one the grader made.
PCH_DIR = "/opt/fastdl/pch"
# The full package, for a reference child (trusted: the course's code and nothing else runs there).
FULL_PACKAGE = Path(autograder.__file__).resolve().parent.parent


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
    host_only: bool = False  # an item measured on the host: no GPU in its child, even on a GPU profile


def _digest(*parts) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def student_seed(seed: int, lab: str, student: str, attempt: str = "") -> int:
    """Every student's hidden inputs differ, and so do every attempt's (``attempt``: the digest of
    the submission's solution cells, ``attempt_digest``): feedback on one attempt says nothing of
    the next one's inputs, even under a recorded batch seed, which still regrades the same
    submission identically."""
    return _digest(seed, lab, student, attempt) if attempt else _digest(seed, lab, student)


def attempt_digest(path: Path) -> str:
    """What makes a submission an attempt of its own: its solution cells, nothing else of the file
    (a notebook saved again with other outputs is the same attempt). Empty for an unreadable one."""
    try:
        solutions = notebook.graded_cells(notebook.read_notebook(path)).solutions
    except notebook.NotebookError:
        return ""
    return hashlib.sha256(json.dumps(sorted(solutions.items())).encode()).hexdigest()[:16]


def item_seed(seed: int, item: str) -> int:
    return _digest(seed, item)


def _child_env(sandbox: Sandbox, home: str) -> dict[str, str]:
    if sandbox.isolated:
        where = {"home": bwrap.JOB, "PYTHONPATH": f"{bwrap.STUDENT_DIR}:{GRADER_DIR}"}
    else:
        where = {"home": home, "tmp": home,
                 "PYTHONPATH": f"{sandbox.student_package}:{Path(autograder.__file__).parent.parent}"}
    gpu = bool(sandbox.profile.get("gpu")) and not sandbox.host_only
    return bwrap.environment(gpu=gpu, PYTHONHASHSEED="0", MPLBACKEND="Agg",
                             OMP_NUM_THREADS=str(sandbox.profile.get("threads", 1)), **where)


def _triton_key() -> str:
    """The name Triton gives this installation (cached by Triton: hashed once per process)."""
    from triton.runtime.cache import triton_key

    return triton_key()


class _Workdir:
    """The grader's folder for one child: its job, its inputs (less what the item withholds), the
    student's extracted code (or the files the grader built from it, ``built``) and the channel's
    socket. The child sees it read-only, as ``/job/in``; what the child writes goes to its own
    ``/job``, a tmpfs that ends with it. A reference child and a build child (mode "build") get no
    code of the student's."""

    BUILT = "built"

    def __init__(self, lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, *, mode: str,
                 params: dict, within: Path | None = None, reference: bool = False,
                 built: dict[str, bytes] | None = None):
        # Only the jit functions, screened classes and functions, and constants of an extracted
        # item's cells reach the child; a rejected one raises here, before anything is made.
        student = not reference and mode != "build" and item.built is None
        sources = [cells[c] for c in item.cells] if student else []
        kernel_source = kernels.extract(sources, item.kernels) if item.kernels and student else None
        artefact_source = (artefacts.extract(sources, item.artefacts, item.library)
                           if item.artefacts and student else None)
        self.path = tempfile.mkdtemp(prefix=f"fastdl-{item.name}-", dir=within)
        self.home = os.path.join(self.path, "home")  # the child's writable folder when run without a sandbox
        self.job = {"lab": lab.name, "item": item.name, "preamble": lab.preamble, "cells": [], "mode": mode,
                    "params": params, "instruments": list(item.instruments), "reference": reference}
        if kernel_source is not None:
            self._write("kernels.py", kernel_source)
            self.job.update(kernel_module="kernels.py", triton_key=_triton_key())
        if artefact_source is not None:
            self._write("artefacts.py", artefact_source)
            self.job.update(artefact_module="artefacts.py", scope=item.scope,
                            instruments=[*self.job["instruments"], *artefacts.GRAD_DESCRIPTORS])
        if built is not None:
            self._write_built(built)
        if kernel_source is None and artefact_source is None and student:
            for i, cell_id in enumerate(item.cells):
                name = f"cell_{i}_{cell_id}.py"
                self._write(name, cells[cell_id])
                self.job["cells"].append({"id": cell_id, "file": name})
        if reference and item.kernels:
            self.job["triton_key"] = _triton_key()
        self._write("job.json", json.dumps(self.job))
        sent = {key: value for key, value in inputs.items() if key not in item.withheld}
        wire.dump(sent, os.path.join(self.path, INPUTS))
        os.chmod(os.path.join(self.path, INPUTS), 0o644)
        # The grader's folder: readable by the sandbox's uid, writable by nobody but the grader.
        os.chmod(self.path, 0o755)

    def _write(self, name: str, text: str) -> None:
        path = Path(self.path, name)
        path.write_text(text)
        path.chmod(0o644)

    def _write_built(self, files: dict[str, bytes]) -> None:
        folder = Path(self.path, self.BUILT)
        folder.mkdir(mode=0o755)
        self.job["built"] = {}
        for name, data in files.items():
            if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}", name) or not isinstance(data, bytes):
                raise ValueError(f"a built file must be bytes under a plain name, not {name!r}")
            (folder / name).write_bytes(data)
            (folder / name).chmod(0o644)
            self.job["built"][name] = f"{self.BUILT}/{name}"

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


def _item_env(sandbox: Sandbox, home: str, headers: Path | None) -> dict[str, str]:
    env = _child_env(sandbox, home)
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
    if profile.get("gpu") and any(item.host_only for item in lab.items):
        # The host's children see no GPU: on a GPU profile they are forked from a server of their own.
        prefork.server_for(_item_env(replace(sandbox, host_only=True), bwrap.JOB, None), gpu=False)


@dataclass
class _Run:
    """One child's end: how the process ended, and what came over its channel."""

    result: ChildResult
    received: channel.Received
    services: dict = field(default_factory=dict)


_COMPILED = threading.Lock()
_compiled = False


def compile_grader() -> None:
    """Byte-compile the grader's own modules and the full package where they lie, once per
    process. Every sandboxed child imports them from a read-only mount with
    PYTHONDONTWRITEBYTECODE set (a reference child the full package too), so each would compile
    them from source again: about 50 ms of every one of lab 07's rank children, of which a
    submission starts dozens. Python checks a cached file against its source's size and
    modification time; a folder the grader cannot write is left as it is."""
    global _compiled
    import compileall
    import contextlib
    import io

    with _COMPILED:
        if _compiled:
            return
        _compiled = True
        for folder in (Path(autograder.__file__).resolve().parent, FULL_PACKAGE / "fastdl_lab"):
            if folder.is_dir():
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    compileall.compile_dir(str(folder), quiet=2, workers=1)


def _run_child(work: _Workdir, limits: Limits, sandbox: Sandbox, headers: Path | None = None, *,
               services: dict | None = None, started=None, listening=None) -> _Run:
    """Run the child of ``work`` to its end; ``services`` answer its calls (``{name: service}``,
    each with ``handle(**args)`` and ``record()``); ``listening(endpoint)`` is called once its
    channel listens, ``started(jail)`` once the child runs."""
    services = services or {}
    if sandbox.isolated:
        compile_grader()
    endpoint = channel.Endpoint(work.path, {name: service.handle for name, service in services.items()})
    if listening is not None:
        listening(endpoint)
    try:
        gpu = bool(sandbox.profile.get("gpu")) and not sandbox.host_only
        if not sandbox.isolated:
            os.makedirs(work.home, exist_ok=True)
            env = _item_env(sandbox, work.home, headers)
            argv = [sys.executable, "-m", "autograder.engine.child", work.path]
            result = run_sandboxed(argv, limits=limits, cwd=work.home, env=env, started=started)
        else:
            env = _item_env(sandbox, bwrap.JOB, headers)
            package = FULL_PACKAGE if work.job.get("reference") else sandbox.student_package
            read_only = {str(package): bwrap.STUDENT_DIR, str(Path(autograder.__file__).parent): f"{GRADER_DIR}/autograder"}
            if headers is not None:
                read_only[str(headers)] = f"{PCH_DIR}/{headers.name}"
            view = bwrap.View(work.path, read_only=read_only, gpu=gpu, job_bytes=bwrap.JOB_BYTES)
            argv = [bwrap.PYTHON, "-m", "autograder.engine.child", JOB_IN]
            result = run_sandboxed(argv, limits=limits, cwd=work.path, env=env, view=view,
                                   server=prefork.server_for(env, gpu=view.gpu), started=started)
    finally:
        received = endpoint.close()
    return _Run(result, received, {name: service.record() for name, service in services.items()})


class _Refused(Exception):
    """What came back is not a delivery the grader grades: ``status`` and ``reason`` of the verdict."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _outputs(run: _Run):
    """The one delivery of the child's outputs, or ``_Refused``."""
    received = run.received
    if received.problem:
        raise _Refused("failed", f"the channel to the grader broke: {received.problem}")
    if not received.outputs:
        raise _Refused("failed", "the code ended before the grader's runner could deliver the outputs "
                                 "(sys.exit or os._exit in a solution cell?)")
    if received.deliveries > 1:
        raise _Refused("tampered", f"outputs were delivered {received.deliveries} times; the grader's runner "
                                   "delivers them once")
    return received.outputs[0]


# Numbers with many digits in text a child wrote: what a student's exception would echo of its
# hidden inputs (a tensor's values, a seed) never reaches the reason shown back to the student.
_LONG_NUMBER = re.compile(r"-?\d+\.\d{3,}(?:[eE][-+]?\d+)?|-?\d{5,}")


def redact_numbers(text: str) -> str:
    return _LONG_NUMBER.sub("#", text)


def _failure(item: Item, run: _Run) -> ItemResult:
    result = run.result
    reported = None
    if result.status == "error" and run.received.errors:
        first = run.received.errors[0]
        known = ("error", "tampered", "not_a_kernel", faults.MACHINE)
        reported = (first["status"] if first["status"] in known else "error", first["error"])
    fault = faults.machine_fault(reported, result.output_tail) if result.status == "error" else None
    if fault:
        return ItemResult(item.name, 0.0, item.points, faults.NOT_GRADED, clean_reason(fault), wall_s=result.wall_s)
    if reported:
        status, message = reported[0], redact_numbers(reported[1])
        if status == "error":
            message = f"your code raised {message}"
        return ItemResult(item.name, 0.0, item.points, status, clean_reason(message), wall_s=result.wall_s)
    reason = result.reason
    if result.status == "error":
        reason = f"{result.reason}: {redact_numbers(result.output_tail[-200:].strip())}"
    return ItemResult(item.name, 0.0, item.points, result.status, clean_reason(reason), wall_s=result.wall_s,
                      details={"output_tail": result.output_tail[-1000:]})


def _observed(run: _Run, reference: dict | None = None, timings: dict | None = None) -> Observed:
    return Observed(peak_bytes=run.result.peak_bytes, peak_source=run.result.peak_source, wall_s=run.result.wall_s,
                    processes=run.result.processes, services=run.services, timings=timings or {},
                    reference=reference or {})


def _judge(item: Item, inputs: dict, outputs, params: dict, observed: Observed | None = None) -> Verdict:
    try:
        if "observed" in inspect.signature(item.check).parameters:
            return item.check(inputs, outputs, params, observed=observed or Observed())
        return item.check(inputs, outputs, params)
    except Exception as exc:  # noqa: BLE001 - outputs of the wrong type or shape end here
        return Verdict.failed(f"outputs have the wrong form: {type(exc).__name__}: {exc}")


def _from_verdict(item: Item, verdict: Verdict, wall_s: float) -> ItemResult:
    fraction = min(1.0, max(0.0, float(verdict.fraction)))
    status = "passed" if fraction == 1.0 else "partial" if fraction > 0 else "failed"
    return ItemResult(item.name, round(item.points * fraction, 4), item.points, status, clean_reason(verdict.reason),
                      True, wall_s, verdict.details)


def _item_limits(item: Item, profile: dict, building: bool = False) -> Limits:
    """The limits of an item's child; ``building``: of its build child (``Item.built``), which alone
    gets the build's time when the item has one."""
    limits = profiles.limits(profile)
    if building or item.built is None:
        limits.wall_s += item.build_s
        limits.cpu_s += 2 * item.build_s
    return limits


def _grade_item(lab: LabSpec, item: Item, cells: dict[str, str], seed: int, sandbox: Sandbox) -> ItemResult:
    params = profiles.item_params(sandbox.profile, lab.name, item.name)
    inputs = item.make_inputs(item_seed(seed, item.name), params)
    if item.host_only:
        sandbox = replace(sandbox, host_only=True)
    if item.clocked is not None:
        return _grade_clocked(lab, item, cells, seed, sandbox, params, inputs)
    if item.worlds is not None:
        from autograder.engine import worlds  # it builds on this module's children

        return worlds.grade_worlds(lab, item, cells, sandbox, params, inputs)
    mode = "speed" if item.is_speed else "check"
    if mode == "speed":
        params = {**params, "order_seed": item_seed(seed, "order") % (1 << 31)}
    built = None
    if item.built is not None:
        built = _build(lab, item, cells, sandbox, params)
        if isinstance(built, ItemResult):
            return built
    try:
        work = _Workdir(lab, item, cells, inputs, mode=mode, params=params, within=sandbox.scratch, built=built)
    except kernels.KernelRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "not_a_kernel", clean_reason(str(exc)))
    except artefacts.ArtefactRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    # The reference child (when the item has one and this process has not measured it yet) runs
    # beside the student's: each is measured in its own cgroup, and the item waits for the longer
    # of the two instead of their sum.
    ahead = ThreadPoolExecutor(max_workers=1) if item.reference_run else None
    try:
        pending = ahead.submit(reference_figures, lab, item, params, sandbox) if ahead else None
        headers = _precompiled_headers() if item.torch_headers and item.built is None else None
        services = item.services(inputs, params) if item.services else None
        run = _run_child(work, _item_limits(item, sandbox.profile), sandbox, headers, services=services)
        reference = pending.result() if pending else None
        if reference is not None and reference.get("status") != "ok":
            return ItemResult(item.name, 0.0, item.points, "not_graded",
                              clean_reason(f"the grader's reference run failed ({reference.get('reason')}): "
                                           "a fault of the grading machine, not of the submission"))
        if not run.result.ok:
            return _failure(item, run)
        try:
            outputs = _outputs(run)
        except _Refused as exc:
            return ItemResult(item.name, 0.0, item.points, exc.status, clean_reason(exc.reason), wall_s=run.result.wall_s)
        if mode == "check":
            verdict = _judge(item, inputs, outputs, params, _observed(run, reference))
            return _from_verdict(item, verdict, run.result.wall_s)
        return _speed_result(item, inputs, outputs, params, sandbox.profile, speed.timing_marks(run.received.marks))
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True)  # no reference child outlives its item
        work.remove()


def _build(lab: LabSpec, item: Item, cells: dict[str, str], sandbox: Sandbox,
           params: dict) -> dict[str, bytes] | ItemResult:
    """The files the student's child of a ``Built`` item receives: the source (a string constant of
    the cells, read without running them) compiled in a build child, whose output the item's screen
    judges here. An ``ItemResult`` where there is nothing to hand over (the build failed, or the
    screen refused what it made)."""
    try:
        source = artefacts.string_constant([cells[c] for c in item.cells], item.built.constant)
    except artefacts.ArtefactRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    work = _Workdir(lab, item, {}, {"source": source}, mode="build", params=params, within=sandbox.scratch)
    try:
        headers = _precompiled_headers() if item.torch_headers else None
        run = _run_child(work, _item_limits(item, sandbox.profile, building=True), sandbox, headers)
    finally:
        work.remove()
    if not run.result.ok:
        return _failure(item, run)
    try:
        made = _outputs(run)
    except _Refused as exc:
        return ItemResult(item.name, 0.0, item.points, exc.status, clean_reason(exc.reason),
                          wall_s=run.result.wall_s)
    try:
        return item.built.screen(source, made, params)
    except BuildRefused as exc:
        return ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)), wall_s=run.result.wall_s)
    except Exception as exc:  # noqa: BLE001 - what came back is judged as _judge judges outputs
        return ItemResult(item.name, 0.0, item.points, "failed",
                          clean_reason(f"the build's output is not what the grader reads: {type(exc).__name__}: {exc}"))


# The reference child's figures per (lab, item, parameters, profile): they depend on the item's
# sizes, never on one student's values, so one trusted run serves a grading process.
_REFERENCE_FIGURES: dict[tuple, dict] = {}
# One lock per key, so that two items' reference children run side by side (each item's thread
# waits only for its own), and one guarding the table of locks.
_REFERENCE_LOCKS: dict[tuple, threading.Lock] = {}
_REFERENCE_LOCK = threading.Lock()
# The inputs of a reference run: any seed gives the same sizes.
REFERENCE_SEED = 0


def reference_figures(lab: LabSpec, item: Item, params: dict, sandbox: Sandbox) -> dict:
    """What the course's own implementation measures as the item's child would (its memory peak, its
    wall time), run once per grading process in a trusted child of the same sandbox and limits."""
    key = (lab.name, item.name, json.dumps(params, sort_keys=True, default=str), sandbox.profile.get("name"),
           sandbox.isolated, sandbox.host_only)
    with _REFERENCE_LOCK:
        lock = _REFERENCE_LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key in _REFERENCE_FIGURES:
            return _REFERENCE_FIGURES[key]
        inputs = item.make_inputs(REFERENCE_SEED, params)
        work = _Workdir(lab, item, {}, inputs, mode="check", params=params, within=sandbox.scratch, reference=True)
        try:
            run = _run_child(work, _item_limits(item, sandbox.profile), sandbox)
        finally:
            work.remove()
        reported = "; ".join(e["error"] for e in run.received.errors)
        figures = {"status": run.result.status if run.result.ok and run.received.outputs else "failed",
                   "reason": "; ".join(filter(None, (run.result.reason, reported)))[:300],
                   "peak_bytes": run.result.peak_bytes, "peak_source": run.result.peak_source,
                   "wall_s": run.result.wall_s, "processes": run.result.processes}
        if figures["status"] == "failed" and not figures["reason"]:
            figures["reason"] = "no outputs"
        # Only a run that delivered is kept: a reference child that failed once (a machine briefly
        # short of time or memory) runs again for the next submission rather than leaving every
        # later one of this process not graded.
        if figures["status"] == "ok":
            _REFERENCE_FIGURES[key] = figures
        return figures


def _freeze(jail, frozen: bool) -> None:
    """Stop (or resume) every process of a child: its cgroup's freezer, else SIGSTOP to each."""
    if jail is None or jail.freeze(frozen):
        return
    for pid in jail.pids():
        try:
            os.kill(pid, signal.SIGSTOP if frozen else signal.SIGCONT)
        except OSError:
            pass


class _Session:
    """One child driven call by call (mode "session"): it runs in a thread of its own, and its
    endpoint's ``call`` times each request on the grader's clock."""

    def __init__(self, work: _Workdir, limits: Limits, sandbox: Sandbox):
        self.work, self.jail, self.run = work, None, None
        self.endpoint: channel.Endpoint | None = None
        self._thread = threading.Thread(target=self._main, args=(limits, sandbox), daemon=True)
        self._thread.start()

    def _main(self, limits: Limits, sandbox: Sandbox) -> None:
        def started(jail) -> None:
            self.jail = jail

        def listening(endpoint: channel.Endpoint) -> None:
            self.endpoint = endpoint

        self.run = _run_child(self.work, limits, sandbox, started=started, listening=listening)

    def ready(self, timeout_s: float) -> bool:
        """Whether the child connected to its channel within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.endpoint is None and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        return self.endpoint is not None and self.endpoint.wait_connected(max(0.0, deadline - time.monotonic()))

    def freeze(self, frozen: bool) -> None:
        _freeze(self.jail, frozen)

    def finish(self, timeout_s: float) -> "_Run | None":
        if self.endpoint is not None:
            self.endpoint.finish()
        self._thread.join(timeout_s)
        return self.run


def _grade_clocked(lab: LabSpec, item: Item, cells: dict[str, str], seed: int, sandbox: Sandbox, params: dict,
                   inputs: dict) -> ItemResult:
    """A speed figure on the grader's clock (``items.Clocked``): the student's child and a reference
    child, each driven call by call with inputs made here, the one not timed frozen."""
    clocked = item.clocked
    try:
        mine = _Workdir(lab, item, cells, inputs, mode="session", params=params, within=sandbox.scratch)
    except artefacts.ArtefactRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    except kernels.KernelRejected as exc:
        return ItemResult(item.name, 0.0, item.points, "not_a_kernel", clean_reason(str(exc)))
    theirs = _Workdir(lab, item, {}, inputs, mode="session", params=params, within=sandbox.scratch, reference=True)
    limits = _item_limits(item, sandbox.profile)
    sides = {"candidate": _Session(mine, limits, sandbox), "baseline": _Session(theirs, limits, sandbox)}
    warmup, reps = int(params.get("warmup", clocked.warmup)), int(params.get("reps", clocked.reps))
    order = _call_order(item_seed(seed, "order"), warmup + reps)
    timings: dict = {"candidate_s": [], "baseline_s": [], "candidate": [], "baseline": [], "withheld": []}
    failure: ItemResult | None = None
    try:
        for role, session in sides.items():
            if not session.ready(limits.wall_s):
                failure = _session_failure(item, role, session, "did not start")
                break
        for i, first in ([] if failure else enumerate(order)):
            args, kept = call_arguments(clocked, item_seed(seed, f"call{i}"), params, i)
            if i >= warmup:
                timings["withheld"].append(kept)
            for role in (first, "baseline" if first == "candidate" else "candidate"):
                other = "baseline" if role == "candidate" else "candidate"
                sides[other].freeze(True)
                sides[role].freeze(False)
                try:
                    value, seconds = sides[role].endpoint.call("run", limits.wall_s, **args)
                except channel.ChannelError as exc:
                    failure = _session_failure(item, role, sides[role], str(exc))
                    break
                if i >= warmup:
                    timings[f"{role}_s"].append(seconds)
                    timings[role].append(value)
            if failure:
                break
    finally:
        runs = {}
        for role, session in sides.items():
            session.freeze(False)
            runs[role] = session.finish(limits.wall_s + 10)
        mine.remove()
        theirs.remove()
    if failure is not None:
        return failure
    run = runs["candidate"]
    if run is None:
        return ItemResult(item.name, 0.0, item.points, "not_graded", "the grader lost the child's run")
    observed = _observed(run, timings=timings)
    verdict = _judge(item, inputs, None, params, observed)
    return _from_verdict(item, verdict, sum(timings["candidate_s"]))


def call_arguments(clocked: Clocked, seed: int, params: dict, i: int) -> tuple[dict, dict]:
    """The ``i``-th call's inputs, split: what both children are sent, and what stays here (the keys
    ``clocked.withheld`` names: the labels its outputs are judged on)."""
    args = clocked.call_inputs(seed, params, i)
    return ({key: value for key, value in args.items() if key not in clocked.withheld},
            {key: args[key] for key in clocked.withheld if key in args})


def _call_order(seed: int, calls: int) -> list[str]:
    """Which side each call starts with: drawn per call, so neither always runs first."""
    import random

    rng = random.Random(seed)
    return [rng.choice(("candidate", "baseline")) for _ in range(calls)]


def _session_failure(item: Item, role: str, session: _Session, what: str) -> ItemResult:
    if role == "baseline":
        return ItemResult(item.name, 0.0, item.points, "not_graded",
                          clean_reason(f"the grader's reference run {what}: a fault of the grading machine, "
                                       "not of the submission"))
    # What the child said before it ended (a construction that raised, an instrument replaced) names
    # the cause better than the line it closed; both are the student's text, numbers redacted.
    reported = session.endpoint.received.errors if session.endpoint is not None else []
    if reported:
        known = ("error", "tampered", "not_a_kernel", faults.MACHINE)
        status = reported[0]["status"] if reported[0]["status"] in known else "error"
        fault = faults.machine_fault((status, reported[0]["error"]), "")
        if fault:
            return ItemResult(item.name, 0.0, item.points, faults.NOT_GRADED, clean_reason(fault))
        message = redact_numbers(reported[0]["error"])
        return ItemResult(item.name, 0.0, item.points, status,
                          clean_reason(f"your code raised {message}" if status == "error" else message))
    return ItemResult(item.name, 0.0, item.points, "error", clean_reason(f"the timed call {redact_numbers(what)}"))


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


class ConfigurationError(Exception):
    """A lab's item the engine will not grade as written: the course's mistake, never a student's."""


def refuse_misconfigured(lab: LabSpec, item: Item) -> None:
    """Student Python is never timed in its own process, where it can forge the clock and the
    samples: a speed item is either a kernel item (only the student's ``@triton.jit`` functions
    reach its child, which times them) or ``clocked`` (the grader's clock times each call)."""
    pure_kernel = bool(item.kernels) and not item.artefacts
    if item.is_speed and item.clocked is None and not pure_kernel:
        raise ConfigurationError(
            f"lab {lab.name}, item {item.name}: a speed item of student Python must be clocked "
            "(Item.clocked: timed call by call on the grader's clock); only a kernel item, whose child runs "
            "no student Python, may be timed inside its child")
    if item.worlds is not None and (item.is_speed or item.clocked or item.built or item.drive is None):
        raise ConfigurationError(f"lab {lab.name}, item {item.name}: an item graded as worlds of ranks runs its "
                                 "drive in every rank and is judged on what the relay saw; it is neither timed "
                                 "nor built")
    if item.worlds is not None and item.worlds.reference_worlds is not None and item.reference is None:
        raise ConfigurationError(f"lab {lab.name}, item {item.name}: reference worlds need a reference "
                                 "(Item.reference) for their trusted ranks")
    if item.clocked is not None and item.reference is None:
        raise ConfigurationError(f"lab {lab.name}, item {item.name}: a clocked item needs a reference "
                                 "(Item.reference) for its baseline child")


def run_items(items: list[Item], grade_one, parallel: int, alongside=None) -> list[ItemResult]:
    """``grade_one`` every item, in the order given: all but the speed items ``parallel`` at a
    time, then each speed item alone, once every other item's child has ended, so nothing shares
    the GPU (or the cores, or the memory bus) with the code being timed.

    ``alongside``, a callable (nbgrader's run of the notebook), takes one of the ``parallel``
    slots beside the items, and also ends before the first speed item starts; what it raises is
    raised here, after every item's child has ended."""
    from concurrent.futures import ThreadPoolExecutor

    shared = [i for i, item in enumerate(items) if not item.runs_alone]
    alone = [i for i, item in enumerate(items) if item.runs_alone]
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
    raises for the student's doing (``ConfigurationError``, before any child runs, for the course's).
    ``alongside`` runs once, as ``run_items`` says. The children's
    work folders are made in ``scratch`` (the job's folder), else in the temporary directory."""
    items = [it for it in lab.items if only is None or it.name in only]
    for item in items:
        refuse_misconfigured(lab, item)
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
