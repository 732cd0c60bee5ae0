"""The trusted grading engine: one submission of one lab in, one verdict per item out.

This process never imports or executes student code. Each item's solution cells run in a fresh
sandboxed child (``child.py``); inputs come from a secret seed; the item's ``check`` compares the
child's outputs with references computed here; speed items are timed from here.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

import torch

from autograder import notebook, profiles
from autograder.engine.items import Item, LabSpec, Verdict
from autograder.engine.sandbox import ChildResult, Limits, run_sandboxed

NEEDS_GPU = "needs a GPU: speed is graded only on GPU profiles; left out of the total"


@dataclass
class ItemResult:
    item: str
    score: float
    max_score: float
    status: str  # passed | partial | failed | error | timeout | crashed | memory | output | ... | needs_gpu
    reason: str
    counted: bool = True  # False: visibly left out of the total (needs a GPU on this profile)
    wall_s: float = 0.0
    details: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def item_seed(seed: int, item: str) -> int:
    digest = hashlib.sha256(f"{seed}:{item}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _child_env(workdir: str, student_package: Path, profile: dict) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "PYTHONPATH": str(student_package),
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
        "OMP_NUM_THREADS": str(profile.get("threads", 1)),
        "TRITON_CACHE_DIR": os.path.join(workdir, "triton-cache"),
        "TMPDIR": workdir,
    }
    if not profile.get("gpu"):
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    for var in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "CUDA_HOME"):
        if var in os.environ and var not in env:
            env[var] = os.environ[var]
    return env


class _Workdir:
    """A private directory holding one child's job, inputs and outputs."""

    def __init__(self, lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, *, role: str, mode: str):
        self.path = tempfile.mkdtemp(prefix=f"fastdl-{item.name}-")
        files = []
        for i, cell_id in enumerate(item.cells if role == "candidate" else ()):
            name = f"cell_{i}_{cell_id}.py"
            Path(self.path, name).write_text(cells[cell_id])
            files.append({"id": cell_id, "file": name})
        self.job = {"lab": lab.name, "item": item.name, "preamble": lab.preamble, "cells": files, "role": role, "mode": mode}
        torch.save(inputs, os.path.join(self.path, "inputs.pt"))

    def write_job(self, **extra) -> None:
        Path(self.path, "job.json").write_text(json.dumps({**self.job, **extra}))

    def error(self) -> str | None:
        path = Path(self.path, "error.json")
        if not path.exists():
            return None
        try:
            return json.loads(path.read_text())["error"]
        except (ValueError, KeyError, TypeError):
            return "the child reported an error it could not describe"

    def outputs(self):
        return torch.load(os.path.join(self.path, "outputs.pt"), weights_only=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _run_child(work: _Workdir, limits: Limits, env: dict, pass_fds: tuple[int, ...] = ()) -> ChildResult:
    argv = [sys.executable, "-m", "autograder.engine.child", work.path]
    return run_sandboxed(argv, limits=limits, cwd=work.path, env=env, pass_fds=pass_fds)


def _failure(item: Item, result: ChildResult, work: _Workdir) -> ItemResult:
    if result.status == "error":
        message = work.error() or f"{result.reason}: {result.output_tail[-300:].strip()}"
        return ItemResult(item.name, 0.0, item.points, "error", f"your code raised {message}")
    return ItemResult(item.name, 0.0, item.points, result.status, result.reason, details={"output_tail": result.output_tail[-1000:]})


def _judge(item: Item, inputs: dict, work: _Workdir, params: dict) -> Verdict:
    try:
        outputs = work.outputs()
    except FileNotFoundError:
        return Verdict.failed("the code exited without producing outputs (sys.exit or os._exit in a solution cell?)")
    except Exception as exc:  # noqa: BLE001 - a hostile file may fail to load in many ways
        return Verdict.failed(f"outputs could not be read: {type(exc).__name__}")
    try:
        return item.check(inputs, outputs, params)
    except Exception as exc:  # noqa: BLE001 - outputs of the wrong type or shape end here
        return Verdict.failed(f"outputs have the wrong form: {type(exc).__name__}: {exc}"[:500])


def _from_verdict(item: Item, verdict: Verdict, wall_s: float) -> ItemResult:
    fraction = min(1.0, max(0.0, float(verdict.fraction)))
    status = "passed" if fraction == 1.0 else "partial" if fraction > 0 else "failed"
    return ItemResult(item.name, round(item.points * fraction, 4), item.points, status, verdict.reason, True, wall_s, verdict.details)


def _item_limits(item: Item, profile: dict) -> Limits:
    limits = profiles.limits(profile)
    limits.loopback = item.loopback
    limits.max_processes += item.processes
    # Every rank imports torch: resident memory grows with the world.
    limits.memory_bytes += item.processes * (1 << 30)
    return limits


def _grade_correctness(lab, item, cells, seed, profile, student_package) -> ItemResult:
    params = profiles.item_params(profile, lab.name, item.name)
    inputs = item.make_inputs(item_seed(seed, item.name), params)
    work = _Workdir(lab, item, cells, inputs, role="candidate", mode="check")
    try:
        work.write_job()
        env = _child_env(work.path, student_package, profile)
        result = _run_child(work, _item_limits(item, profile), env)
        if not result.ok:
            return _failure(item, result, work)
        return _from_verdict(item, _judge(item, inputs, work, params), result.wall_s)
    finally:
        work.remove()


def _read_byte(fd: int, deadline: float) -> bytes:
    import select

    remaining = deadline - time.monotonic()
    if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
        return b""
    return os.read(fd, 1)


def _grade_speed(lab, item, cells, seed, profile, student_package) -> ItemResult:
    """Candidate and baseline each serve calls in their own child; this process times both."""
    params = profiles.item_params(profile, lab.name, item.name)
    inputs = item.make_inputs(item_seed(seed, item.name), params)
    limits = _item_limits(item, profile)
    children, threads, results = {}, [], {}
    for role in ("candidate", "baseline"):
        control_r, control_w = os.pipe()
        reply_r, reply_w = os.pipe()
        work = _Workdir(lab, item, cells, inputs, role=role, mode="serve")
        work.write_job(control_fd=control_r, reply_fd=reply_w)
        env = _child_env(work.path, student_package, profile)

        def run(role=role, work=work, fds=(control_r, reply_w)):
            results[role] = _run_child(work, limits, env, pass_fds=fds)
            for fd in fds:
                os.close(fd)

        children[role] = (work, control_w, reply_r)
        threads.append(threading.Thread(target=run, daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + limits.wall_s
    samples = {"candidate": [], "baseline": []}
    problem = None
    try:
        for role, (_, _, reply_r) in children.items():
            if _read_byte(reply_r, deadline) != b"r":
                problem = role
                break
        warmup, reps = int(params.get("warmup", 3)), int(params.get("reps", 15))
        order = random.Random(item_seed(seed, "order"))
        for rep in range(warmup + reps if problem is None else 0):
            pair = ["candidate", "baseline"]
            order.shuffle(pair)
            for role in pair:
                _, control_w, reply_r = children[role]
                start = time.perf_counter()
                os.write(control_w, b"c")
                if _read_byte(reply_r, deadline) != b"d":
                    problem = role
                    break
                if rep >= warmup:
                    samples[role].append(time.perf_counter() - start)
            if problem:
                break
    finally:
        for _, control_w, _ in children.values():
            try:
                os.write(control_w, b"q")
            except OSError:
                pass
            os.close(control_w)
        for t in threads:
            t.join()
        for _, _, reply_r in children.values():
            os.close(reply_r)
    work = children["candidate"][0]
    try:
        if problem == "baseline":
            raise RuntimeError(f"the baseline of {item.name} failed: {results['baseline'].reason or 'no reply'}")
        if problem or not results["candidate"].ok:
            return _failure(item, results["candidate"], work)
        verdict = _judge(item, inputs, work, params)
        raw = {"candidate_s": samples["candidate"], "baseline_s": samples["baseline"]}
        if verdict.fraction < 1:
            return ItemResult(item.name, 0.0, item.points, "failed", f"timed output is wrong: {verdict.reason}", details=raw)
        speedup = median(samples["baseline"]) / median(samples["candidate"])
        target = float(params.get("min_speedup", 1.0))
        fraction = 1.0 if speedup >= target else 0.0
        reason = f"speedup {speedup:.2f}x over the baseline (needs {target:.2f}x on the {profile['name']} profile)"
        return ItemResult(item.name, item.points * fraction, item.points, "passed" if fraction else "failed", reason, details={**raw, "speedup": speedup})
    finally:
        for w, _, _ in children.values():
            w.remove()


def grade_submission(
    lab: LabSpec, path: Path, *, release: Path, profile: dict, seed: int, student_package: Path, parallel: int = 2
) -> list[ItemResult]:
    """Grade every item of ``lab`` in the notebook at ``path``; never raises for the student's doing."""
    try:
        submitted = notebook.graded_cells(notebook.read_notebook(path))
    except notebook.NotebookError as exc:
        return [ItemResult(it.name, 0.0, it.points, "invalid_notebook", str(exc)) for it in lab.items]
    released = notebook.graded_cells(notebook.read_notebook(release))

    def grade_one(item: Item) -> ItemResult:
        started = time.monotonic()
        problem = notebook.test_cell_problem(item.name, submitted, released)
        if problem:
            return ItemResult(item.name, 0.0, item.points, "tampered", problem)
        # speed_on_cpu exists to exercise the timing protocol in tests; no real profile sets it.
        if item.is_speed and not (profile.get("gpu") or profile.get("speed_on_cpu")):
            return ItemResult(item.name, 0.0, item.points, "needs_gpu", NEEDS_GPU, counted=False)
        problem = notebook.solution_problem(item.cells, submitted, released)
        if problem:
            status = "unanswered" if problem.startswith("not attempted") else "missing"
            return ItemResult(item.name, 0.0, item.points, status, problem)
        grader = _grade_speed if item.is_speed else _grade_correctness
        result = grader(lab, item, submitted.solutions, seed, profile, student_package)
        result.wall_s = round(time.monotonic() - started, 3)
        return result

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(grade_one, lab.items))
