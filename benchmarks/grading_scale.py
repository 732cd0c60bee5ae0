"""Benchmark of grading a class: throughput against workers, and a load test under faults.

    python benchmarks/grading_scale.py --throughput [--submissions 8] [--workers 1 2]
    python benchmarks/grading_scale.py --load [--submissions 500] [--workers 8] [--kills 2]

``--throughput`` grades copies of lab 00's reference submission through the whole pipeline
(nbgrader's run and the engine) with each number of workers and records submissions per minute
(``results/grading_throughput.csv``). ``--load`` grades a class from ``autograder.loadtest`` (a fifth
of it hostile) with the engine alone on a local Dask cluster, kills a busy worker ``--kills`` times
spread over the run, checks that every submission ends in exactly one final state with the score it
must have, regrades a sample with the same seed, and records the outcome (``results/grading_load.csv``).
Add ``--dry-run`` to print the rows without recording them.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as a script, this folder comes first on the path, and its distributed.py (lab 07's benchmark)
# would hide Dask's package of that name.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from autograder import batch, journal, loadtest, profiles
from autograder.course import Course, build
from autograder.submissions import make_submission, reference_solutions
from fastdl_lab import measure


def throughput(course: Course, submissions: int, workers: list[int]) -> list[dict]:
    students = [f"copy-{i:03d}" for i in range(submissions)]
    for student in students:
        make_submission(course, loadtest.LAB, student, reference_solutions(course, loadtest.LAB))
    rows = []
    for n in workers:
        started = time.monotonic()
        done = batch.grade(course, [(loadtest.LAB, s) for s in students], profile=profiles.load("cpu"), seed=0, workers=n)
        seconds = time.monotonic() - started
        rows.append({"lab": loadtest.LAB, "submissions": submissions, "workers": n, "seconds": round(seconds, 1),
                     "per_minute": round(60 * submissions / seconds, 2), "problems": len(done.failures),
                     "load_average": round(os.getloadavg()[0], 2)})
        print(rows[-1], flush=True)
    return rows


def _unfinished_jobs(dask_scheduler) -> int:
    """Grading jobs the scheduler still has to run: not yet taken in ("released", right after the
    client submits them), waiting, queued or on a worker."""
    return sum(1 for key, task in dask_scheduler.tasks.items() if str(key).startswith("grade-")
               and task.state in ("released", "waiting", "queued", "no-worker", "processing"))


def load(course: Course, submissions: int, workers: int, kills: int) -> dict:
    from distributed import Client

    students = loadtest.make_class(course, submissions)
    profile = profiles.load("cpu")
    # A short wall limit keeps the looping kind cheap; it grows with the workers each core serves,
    # or an honest submission's wall time (a few seconds of CPU, shared) runs past it.
    oversubscribed = max(1.0, workers / (os.cpu_count() or 1))
    profile = {**profile, "limits": {**profile["limits"], "wall_s": round(10 * oversubscribed)}}
    jobs = [(loadtest.LAB, s) for s in students]
    # Kill k comes once (k + 1) / (kills + 1) of the jobs are finished on the scheduler, or as soon
    # after as a busy worker holds no job a kill already cost (that one must be retried, not lost).
    # Counted on the scheduler, not by results received: a client starved of CPU receives them in
    # bursts, and by the time it counts two thirds no worker may be busy any more.
    kill_at = [submissions * (k + 1) // (kills + 1) for k in range(kills)]
    killed: list[str] = []  # keys of the jobs that were on a killed worker (running or queued)
    kills_done = []
    started = time.monotonic()
    cluster = batch.local_cluster(workers, gpu=False)
    stop = threading.Event()
    try:
        with Client(cluster, set_as_default=False) as spy:
            def kill_on_schedule():
                seen_jobs = False
                while not stop.is_set() and len(kills_done) < kills:
                    waiting = spy.run_on_scheduler(_unfinished_jobs)
                    seen_jobs = seen_jobs or waiting > 0
                    done = submissions - waiting
                    if seen_jobs and done >= kill_at[len(kills_done)]:
                        for address, keys in spy.processing().items():
                            if keys and not set(keys) & set(killed):
                                killed.extend(keys)
                                kills_done.append(done)
                                os.kill(spy.run(os.getpid, workers=[address])[address], signal.SIGKILL)
                                print(f"killed the worker holding {', '.join(keys)} with {done} jobs finished",
                                      flush=True)
                                break
                    stop.wait(1.0)

            def progress(done, total, record):
                if done % 50 == 0:
                    print(f"{done}/{total} in {time.monotonic() - started:.0f} s", flush=True)

            killer = threading.Thread(target=kill_on_schedule, daemon=True)
            killer.start()
            summary = batch.grade(course, jobs, profile=profile, seed=1, scheduler=cluster.scheduler_address,
                                  execute=False, only=[loadtest.ITEM], progress=progress)
            stop.set()
            killer.join()
    finally:
        cluster.close()
    seconds = time.monotonic() - started
    events = [json.loads(line) for line in (course.root / "runs" / f"{summary.run_id}.jsonl").read_text().splitlines()]
    finals = [(e["lab"], e["student"]) for e in events if e["event"] == "final"]
    states = [e["state"] for e in events if e["event"] == "final"]
    scores = {}
    for student in students:
        record = json.loads((course.records / loadtest.LAB / f"{student}.json").read_text())
        scores[student] = (record["items"][0]["score"], record["items"][0]["status"])
    wrong = [s for s in students if loadtest.expected(s) is not None and scores[s] != loadtest.expected(s)]
    sample = students[:: max(1, len(students) // 20)]
    batch.grade(course, [(loadtest.LAB, s) for s in sample], profile=profile, seed=1, workers=min(2, workers),
                execute=False, only=[loadtest.ITEM])
    regraded = {s: json.loads((course.records / loadtest.LAB / f"{s}.json").read_text())["items"][0] for s in sample}
    changed = {s: (scores[s], (r["score"], r["status"])) for s, r in regraded.items() if (r["score"], r["status"]) != scores[s]}
    if changed:
        print(f"regrade differs: {changed}")
    return {"lab": loadtest.LAB, "submissions": submissions, "hostile": sum(loadtest.expected(s) is None for s in students),
            "workers": workers, "workers_killed": len(kills_done), "seconds": round(seconds, 1),
            "per_minute": round(60 * submissions / seconds, 2),
            "lost": len(set(jobs) - set(finals)), "graded_twice": len(finals) - len(set(finals)),
            "not_graded": states.count(journal.NOT_GRADED), "wrong_scores": len(wrong),
            "regrade_identical": not changed}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--throughput", action="store_true")
    mode.add_argument("--load", action="store_true")
    parser.add_argument("--submissions", type=int)
    parser.add_argument("--workers", type=int, nargs="*")
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="print the rows, record nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        course = Course(Path(tmp))
        build(course, [loadtest.LAB])
        if args.throughput:
            name, rows = "grading_throughput", throughput(course, args.submissions or 8, args.workers or [1, 2])
        else:
            name, rows = "grading_load", [load(course, args.submissions or 500, (args.workers or [8])[0], args.kills)]
            print(rows[0])
    if not args.dry_run:
        print(f"appended {len(rows)} rows to {measure.append_results(name, rows)}")


if __name__ == "__main__":
    main()
