"""Grading many submissions: jobs out to workers, results back to one writer.

Each submission is an independent job (``jobs.grade_job``). With one worker the jobs run here,
one after another. With more, they run on Dask distributed: a local cluster of worker processes
(``--workers N``), or an existing cluster (``--scheduler ADDRESS``) whose workers see the course
folder. On a GPU profile every job asks for one ``GPU`` resource, and each worker declares one,
so a speed item never shares its GPU with another submission.

Whatever the executor, this process alone writes the grades (records, the autograded notebooks,
the gradebook) and the run journal, in the order results arrive. A worker that dies loses only
the job it held: the scheduler gives that job to another worker once, and a second loss is
recorded as ``not_graded`` with the reason, like a fault of the grader itself. Nothing is graded
twice: a job's result is written once, and the journal records each submission's final state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from autograder import gradebook, journal, notebook, records, workfolder
from autograder.course import Course
from autograder.engine import bwrap, toolchain
from autograder.engine.grade import NEEDS_GPU
from autograder.engine.items import load_lab
from autograder.jobs import JobResult, JobSpec, grade_job, prepare_scratch
from fastdl_lab import device

NOT_GRADED = journal.NOT_GRADED
# A job lost with its worker runs once more (the scheduler's allowed-failures; Dask's default is 3).
RETRIES_AFTER_WORKER_LOSS = 1
# A job the cluster cancelled is given again this many times. The scheduler cancels a client's
# jobs when it drops that client: a client starved of CPU on a loaded host misses its heartbeats,
# reconnects, and finds every job it had submitted gone. Nothing of the job was graded then.
RESUBMITS_AFTER_CANCEL = 2
# A worker holds one job at a time, the one it runs. By default (1.1) the scheduler also hands a
# one-thread worker the next job to queue behind it, and a worker that died would cost that job a
# retry too; a job lasts seconds, so there is nothing to gain from handing it out early.
ONE_JOB_PER_WORKER = {"distributed.scheduler.worker-saturation": 1.0}
# Workers must be allowed children of their own: some items' trusted checks run a DataLoader with
# worker processes (lab 06). A nanny reads this each time it starts or restarts its worker.
NON_DAEMONIC_WORKERS = {"distributed.worker.daemon": False}


@dataclass
class BatchSummary:
    jobs: list[tuple[str, str]] = field(default_factory=list)
    graded: dict[tuple[str, str], dict] = field(default_factory=dict)  # job -> its record
    failures: list[str] = field(default_factory=list)  # "lab student: what went wrong" (not the grade)
    seconds: dict[tuple[str, str], float] = field(default_factory=dict)
    run_id: str = ""



def default_workers(profile: dict) -> int:
    """One job per GPU on a GPU profile (a speed item needs its GPU to itself), else per core."""
    if profile.get("gpu"):
        import torch

        return max(1, torch.cuda.device_count())
    return max(1, os.cpu_count() or 1)


def _job_key(lab: str, student: str) -> str:
    # Student folder names are any bytes the file system allows; a scheduler key must be tame.
    return f"grade-{lab}-{hashlib.sha256(student.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}"


def _serial(specs: list[JobSpec]) -> Iterator[dict]:
    for spec in specs:
        yield grade_job(spec)


def _lost(spec: JobSpec, why: str) -> dict:
    return JobResult(spec.lab, spec.student, error=records.clean_reason(why)).as_dict()


def worker_specs(workers: int, gpu: bool) -> dict:
    """Dask worker specifications: one thread each (a job keeps about a core busy); on a GPU host,
    worker i sees GPU i alone and declares it as the resource every job asks for."""
    from distributed import Nanny

    def worker(i: int) -> dict:
        # The workers' own log lines would bury the instructor's progress lines.
        options = {"nthreads": 1, "memory_limit": 0, "silence_logs": logging.ERROR, "dashboard": False}
        if gpu:
            options |= {"resources": {"GPU": 1}, "env": {"CUDA_VISIBLE_DEVICES": str(i)}}
        return {"cls": Nanny, "options": options}

    return {f"grader-{i}": worker(i) for i in range(workers)}


def local_cluster(workers: int, gpu: bool):
    """A cluster of ``workers`` worker processes on this machine, one job at a time each; on a GPU
    host each worker sees one GPU and declares it."""
    import dask
    from distributed import Scheduler, SpecCluster

    # The scheduler reads this when it starts; a cluster of the instructor's sets it in its own config.
    with dask.config.set({"distributed.scheduler.allowed-failures": RETRIES_AFTER_WORKER_LOSS, **ONE_JOB_PER_WORKER,
                          **NON_DAEMONIC_WORKERS}):
        return SpecCluster(
            scheduler={"cls": Scheduler, "options": {"dashboard": False}},
            workers=worker_specs(workers, gpu),
            silence_logs=logging.ERROR,
        )


def _dask(specs: list[JobSpec], *, workers: int, scheduler: str | None, gpu: bool) -> Iterator[dict]:
    import dask

    cluster = None if scheduler else local_cluster(workers, gpu)
    # For the restarts of a local cluster's workers that die while it grades.
    with dask.config.set(NON_DAEMONIC_WORKERS):
        yield from _collect(specs, cluster, scheduler, gpu)


def _collect(specs: list[JobSpec], cluster, scheduler: str | None, gpu: bool) -> Iterator[dict]:
    from distributed import Client, as_completed
    from distributed.client import FutureCancelledError
    from distributed.scheduler import KilledWorker

    try:
        with Client(scheduler or cluster, set_as_default=False) as client:
            resources = {"GPU": 1} if gpu else None

            def submit(spec: JobSpec, attempt: int = 0):
                # A fresh key for a resubmission: the cancelled task's key may linger on the scheduler.
                key = _job_key(spec.lab, spec.student) + (f"-again{attempt}" if attempt else "")
                return client.submit(grade_job, spec, key=key, pure=False, resources=resources)

            futures = {submit(spec): (spec, 0) for spec in specs}
            pending = as_completed(futures, loop=client.loop)
            for future in pending:
                spec, attempt = futures.pop(future)
                try:
                    result = future.result()
                except KilledWorker:
                    result = _lost(spec, f"the grading worker died while holding this submission, "
                                         f"{RETRIES_AFTER_WORKER_LOSS + 1} times: regrade it with --student")
                except FutureCancelledError as exc:
                    if attempt < RESUBMITS_AFTER_CANCEL:
                        again = submit(spec, attempt + 1)
                        futures[again] = (spec, attempt + 1)
                        pending.add(again)
                        future.release()
                        continue
                    result = _lost(spec, f"the cluster cancelled this submission {attempt + 1} times "
                                         f"({exc}): regrade it with --student")
                except Exception as exc:  # noqa: BLE001 - e.g. the scheduler lost the job's data
                    result = _lost(spec, f"the cluster could not grade this submission: {type(exc).__name__}: {exc}")
                future.release()
                yield result
    finally:
        if cluster is not None:
            cluster.close()
            # The folders of jobs on workers killed late in the run, which no later job swept.
            workfolder.remove_abandoned()


def _store(course: Course, result: dict, run: journal.Run, profile: dict, summary: BatchSummary,
           only: tuple[str, ...] | None) -> dict:
    """Write one job's result: the only place grades are written."""
    lab_name, student = result["lab"], result["student"]
    lab = load_lab(lab_name)
    nb_run = {**result.get("nbgrader", {}), "seconds": result.get("seconds", {}).get("nbgrader")}
    timestamp = None
    if result.get("error"):
        items = _lost_items(lab, profile, result["error"], only)
        summary.failures.append(f"{lab_name} {student}: not graded: {result['error']}")
    else:
        items = result["items"]
        if nb_run.get("message"):
            summary.failures.append(f"{lab_name} {student}: {nb_run['message']}")
        if result.get("autograded") is not None:
            target = course.autograded(student, lab_name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(result["autograded"], encoding="utf-8")
        try:
            timestamp = notebook.copy_exchange_notes(course.submitted(student, lab_name).parent,
                                                     course.autograded(student, lab_name).parent)
        except notebook.NotebookError as exc:
            summary.failures.append(f"{lab_name} {student}: {records.clean_reason(exc)}")
    if only:
        items, stale = _with_earlier_verdicts(course, lab, student, items, seed=run.seed,
                                              attempt=result.get("attempt", ""))
        if stale:
            summary.failures.append(f"{lab_name} {student}: {', '.join(stale)} not graded: {STALE}")
    path = records.write(course.records, lab_name, student, profile=profile["name"], seed=run.seed, items=items,
                         nbgrader=nb_run, seconds=result.get("seconds", {}), worker=result.get("worker", ""),
                         attempt=result.get("attempt", ""))
    if not result.get("error"):
        try:
            summary.failures += gradebook.write_scores(course.db_url, lab, student, items,
                                                       auto_grades=result.get("auto_grades"),
                                                       auto_comments=result.get("auto_comments"), timestamp=timestamp)
        except Exception as exc:  # noqa: BLE001 - the record and report still hold the verdicts
            summary.failures.append(f"{lab_name} {student}: gradebook not updated: {records.clean_reason(exc)}")
    run.finish(lab_name, student, NOT_GRADED if result.get("error") else journal.GRADED,
               score=sum(i["score"] for i in items if i["counted"]))
    record = json.loads(path.read_text())
    summary.graded[(lab_name, student)] = record
    summary.seconds[(lab_name, student)] = result.get("seconds", {}).get("total", 0.0)
    return record


def _lost_items(lab, profile: dict, reason: str, only: tuple[str, ...] | None) -> list[dict]:
    """A job the grader lost: every item it was to grade is ``not_graded`` with the reason, but for
    those this profile leaves out of the total, which stay out as in a graded record (the maximum of
    a lost job is the maximum of a graded one)."""
    items = []
    for it in lab.items:
        if only and it.name not in only:
            continue
        if notebook.needs_gpu(it, profile):
            items.append({"item": it.name, "score": 0.0, "max_score": it.points, "status": "needs_gpu",
                          "reason": NEEDS_GPU, "counted": False, "wall_s": 0.0, "details": {}})
        else:
            items.append({"item": it.name, "score": 0.0, "max_score": it.points, "status": NOT_GRADED,
                          "reason": reason, "counted": True, "wall_s": 0.0, "details": {}})
    return items


STALE = ("the submission changed since they were graded, and only other items were regraded: "
         "regrade the whole submission (autograde without --item)")


def _with_earlier_verdicts(course: Course, lab, student: str, items: list[dict], *, seed: int,
                           attempt: str) -> tuple[list[dict], list[str]]:
    """A run that regrades some items (``--item``) replaces those verdicts only: the record keeps
    the student's other verdicts, each with the seed it was graded with where that differs from
    this run's, so that the record and the gradebook (which keeps the other items' scores) give one
    total. Verdicts given on an earlier version of the submission are not kept as they were: they
    become ``not_graded``, named in the second list, since the notebook they judged is gone."""
    path = course.records / lab.name / f"{student}.json"
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return items, []
    regraded = {i["item"]: i for i in items}
    before = {i["item"]: i for i in earlier.get("items", []) if isinstance(i, dict) and "item" in i}
    same_attempt = bool(attempt) and earlier.get("attempt") == attempt
    merged, stale = [], []
    for it in lab.items:
        if it.name in regraded:
            merged.append(regraded[it.name])
        elif it.name in before:
            verdict = dict(before[it.name])
            if verdict.get("seed", earlier.get("seed")) != seed:
                verdict["seed"] = verdict.get("seed", earlier.get("seed"))
            if not same_attempt and verdict.get("counted", True) and verdict.get("status") != NOT_GRADED:
                verdict.update(score=0.0, status=NOT_GRADED, reason=STALE)
                stale.append(it.name)
            merged.append(verdict)
    return merged, stale


def _selection(only: list[str] | None, per_job: list) -> Callable[[str, str], tuple[str, ...] | None]:
    """The items each job grades: ``only`` for every job, unless ``per_job`` names the job."""
    chosen = {(lab, student): tuple(items) for lab, student, items in per_job}

    def items(lab: str, student: str) -> tuple[str, ...] | None:
        picked = chosen.get((lab, student), only)
        return tuple(picked) if picked else None

    return items


def grade(course: Course, jobs: list[tuple[str, str]], *, profile: dict, seed: int, workers: int = 1,
          scheduler: str | None = None, cell_timeout: int | None = None, isolated: bool = True,
          execute: bool = True, only: list[str] | None = None, only_per_job: list | None = None,
          run: journal.Run | None = None,
          progress: Callable[[int, int, dict], None] | None = None,
          stage: Callable[[str], None] | None = None) -> BatchSummary:
    """Grade ``jobs`` ((lab, student) pairs); ``run`` continues an interrupted run (its seed wins).

    ``only`` grades those items of every job; ``only_per_job`` ([lab, student, items] triples, as
    the journal keeps them) chooses the items of the jobs it names.

    ``progress(done, total, record)`` follows each finished submission; ``stage(text)`` says what
    the batch does before the first can finish (nbgrader's scratch course of each lab, made once per
    source: a class's first minutes otherwise pass without a line).

    ``isolated=False`` (``--unsafe-no-isolation``) runs student code without the sandbox and says so
    in every reason; otherwise a machine that cannot isolate raises ``bwrap.IsolationUnavailable``
    before anything is graded. So does ``device.InterpreterBroken`` on a CPU profile where Triton's
    interpreter cannot run the course's kernels, and ``toolchain.ToolMissing`` on a GPU profile
    where no C compiler would build Triton's launcher."""
    if isolated:
        bwrap.check()
    if profile.get("gpu"):
        toolchain.check(gpu=True)
    else:
        # On a CPU profile every kernel runs under Triton's interpreter: where it is broken, every
        # kernel item would grade as the student's error.
        device.check_interpreter()
    run = run or journal.start(course.root, seed=seed, profile=profile["name"], jobs=jobs,
                               options={"execute": execute, "only": only, "only_per_job": only_per_job or [],
                                        "cell_timeout": cell_timeout})
    items_of = _selection(only, only_per_job or [])
    todo = [job for job in jobs if job not in run.final]
    summary = BatchSummary(jobs=list(jobs), run_id=run.run_id)
    workers = min(workers, len(todo))
    scratch = Path(tempfile.mkdtemp(prefix=f".scratch-{run.run_id}-", dir=course.root))
    try:
        labs = sorted({lab for lab, _ in todo}) if execute else []
        prepared = {}
        for n, lab in enumerate(labs, 1):
            started = time.monotonic()
            prepared[lab] = str(prepare_scratch(course, lab, scratch))
            if stage:
                stage(f"nbgrader's scratch course of {lab} ready in {time.monotonic() - started:.1f} s "
                      f"({n}/{len(labs)}; made once per source of the lab, then copied)")
        parallel = max(1, (os.cpu_count() or 1) // max(1, workers))
        specs = [JobSpec(str(course.root), prepared.get(lab, ""), lab, student, profile, run.seed,
                         cell_timeout=cell_timeout, isolated=isolated, execute=execute, item_parallel=min(2, parallel),
                         only=items_of(lab, student))
                 for lab, student in todo]
        results = _serial(specs) if workers <= 1 and not scheduler else \
            _dask(specs, workers=workers, scheduler=scheduler, gpu=bool(profile.get("gpu")))
        for done, result in enumerate(results, 1):
            record = _store(course, result, run, profile, summary, items_of(result["lab"], result["student"]))
            if progress:
                progress(done, len(specs), record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return summary
