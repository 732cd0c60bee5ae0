"""Grading a class: parallel workers, one writer, the run journal, resume, and faults on the way.

The load test grades 24 submissions of lab 00 (one item, the engine alone, to keep it cheap) on a
local Dask cluster of two workers, with eight hostile submissions among them, and kills a worker
twice while each holds a job (one submission of each hostile kind). Every submission must end in exactly one final state, none lost,
none graded twice, and a regrade with the same seed must give the same scores.
"""

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from autograder import batch, cli, journal, loadtest, pipeline, progress
from autograder.course import copy_build
from autograder.engine.items import load_lab
from autograder.engine.sandbox import descendants
from autograder.submissions import make_submission, reference_solutions

LAB, ITEM = loadtest.LAB, loadtest.ITEM
SEED = 4321


@pytest.fixture(scope="module")
def load_course(course, tmp_path_factory):
    """A copy of the built course with a class of 24: 16 honest submissions, one of each hostile kind."""
    copy = copy_build(course, tmp_path_factory.mktemp("load"))
    loadtest.make_class(copy, 24, hostile=len(loadtest.HOSTILE))
    return copy


def _cpu(cpu):
    # A looping submission holds a worker for the whole wall limit: short, so the test stays cheap.
    return {**cpu, "limits": {**cpu["limits"], "wall_s": 10}}


def _left_behind(before: set[int], wait_s: float = 15) -> list[str]:
    """Command lines of this test's processes still alive, after ``wait_s`` for them to finish closing.
    multiprocessing's resource tracker is this process's own helper for as long as it lives."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for pid in set(descendants(os.getpid())) - before:
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200]
            except OSError:
                continue
            if "multiprocessing.resource_tracker" not in cmdline:
                left.append(cmdline)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _scores(course, students):
    out = {}
    for student in students:
        record = json.loads((course.records / LAB / f"{student}.json").read_text())
        out[student] = {i["item"]: (i["score"], i["status"]) for i in record["items"]}
    return out


def _kill_a_worker_holding_fresh_jobs(pids: dict, first_keys: list, dask_scheduler=None) -> list[str]:
    """Runs on the scheduler's event loop, so no job moves between the choice and the kill. Kills a
    worker holding jobs none of which a worker death has already cost (one that died twice would
    be lost, rightly). The scheduler first takes the victim for paused: a result the victim sent
    just before its death would otherwise earn it one more job before the scheduler learns of the
    death, and that job, maybe one a death already cost, would count as on it. Returns the keys it
    held, or nothing."""
    first = set(first_keys)
    for address, worker in dask_scheduler.workers.items():
        keys = [ts.key for ts in worker.processing]
        if keys and address in pids and set(keys) <= first and not any(ts.suspicious for ts in worker.processing):
            dask_scheduler.handle_worker_status_change("paused", address, stimulus_id="test-kill")
            os.kill(pids[address], signal.SIGKILL)
            return keys
    return []


@pytest.mark.slow
def test_a_class_survives_hostile_submissions_and_killed_workers(load_course, cpu, tmp_path, monkeypatch):
    from distributed import Client, Future

    course = load_course
    students = course.students(LAB)
    assert len(students) == 24
    jobs = [(LAB, s) for s in students]
    before = set(descendants(os.getpid()))
    # The workers' temporary directory, where the jobs make their folders: this test's own.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    cluster = batch.local_cluster(2, gpu=False)
    killed: list[str] = []  # keys of the jobs that were on a killed worker (running or queued)
    first_keys = [batch._job_key(LAB, s) for s in students]
    kills: list[int] = []  # how many results were in when each kill came
    held: list[int] = []  # how many jobs each killed worker held
    cancelled: list[str] = []  # the key of a job the scheduler was made to cancel
    results = [0]
    stop = threading.Event()
    try:
        with Client(cluster, set_as_default=False) as spy:
            def kill_when_a_worker_qualifies():
                # The first kill after 4 results, the second as soon as a worker qualifies after it:
                # tried every 0.1 s, not only as results come (a worker may qualify while the only
                # jobs running are ones that take their whole time limit). Not later: the workers
                # can finish every job while this process is still writing the grades of the
                # first dozen, and a kill must find a job to interrupt. A job a kill cost goes to
                # the back of the queue (the jobs are of one priority), so it often runs last.
                while not stop.wait(0.1) and len(kills) < 2:
                    done = results[0]
                    if done < 4:
                        continue
                    try:
                        pids = spy.run(os.getpid, on_error="ignore")
                        keys = spy.run_on_scheduler(_kill_a_worker_holding_fresh_jobs, pids, first_keys)
                    except Exception:  # noqa: BLE001 - a worker that died meanwhile: try again
                        continue
                    if keys:
                        killed.extend(keys)
                        kills.append(done)
                        held.append(len(keys))

            def count_and_cancel(done, total, record):
                results[0] = done
                # After 10 results the scheduler cancels a job still to come, as it does every job of
                # a client it dropped: the job must be given again, not recorded as lost.
                if done >= 10 and not cancelled:
                    waiting = [batch._job_key(LAB, s) for s in students if not course.records.joinpath(
                        LAB, f"{s}.json").exists() and batch._job_key(LAB, s) not in killed]
                    if waiting:
                        cancelled.append(waiting[-1])
                        spy.cancel([Future(waiting[-1], spy)], force=True, reason="dropped client")

            killer = threading.Thread(target=kill_when_a_worker_qualifies, daemon=True)
            killer.start()
            try:
                summary = batch.grade(course, jobs, profile=_cpu(cpu), seed=SEED, scheduler=cluster.scheduler_address,
                                      execute=False, only=[ITEM], progress=count_and_cancel)
            finally:
                stop.set()
                killer.join()
    finally:
        cluster.close()

    assert len(kills) == 2 and kills[-1] < len(jobs), f"two busy workers killed mid-run: {kills}"
    assert held == [1, 1], f"a worker holds the one job it runs, none queued behind it: {held}"
    assert len(cancelled) == 1, "a job was cancelled mid-run"
    # Exactly one final state per submission, all graded: the killed workers' jobs were given again.
    events = [json.loads(line) for line in (course.root / "runs" / f"{summary.run_id}.jsonl").read_text().splitlines()]
    finals = [(e["lab"], e["student"]) for e in events if e["event"] == "final"]
    assert sorted(finals) == sorted(jobs)
    lost = {s: summary.graded[(LAB, s)]["items"][0].get("reason") for s in students
            if summary.graded[(LAB, s)]["items"][0]["status"] == journal.NOT_GRADED}
    assert {e["state"] for e in events if e["event"] == "final"} == {journal.GRADED}, (lost, kills, killed, cancelled)
    assert {batch._job_key(LAB, s) for s in students} >= set(killed)

    scores = _scores(course, students)
    hostile = [s for s in students if loadtest.expected(s) is None]
    assert len(hostile) == 8
    for student in students:
        score, status = scores[student][ITEM]
        if student in hostile:
            assert score == 0 and status not in ("passed", "partial", journal.NOT_GRADED), (student, status)
        else:
            assert (score, status) == pytest.approx(loadtest.expected(student)), student
    assert scores["not-json-0005"][ITEM][1] == scores["links-to-another-0006"][ITEM][1] == "invalid_notebook"
    assert scores["deletes-test-0007"][ITEM][1] == "tampered"
    assert scores["loops-0001"][ITEM][1] == "timeout"
    assert not _left_behind(before), "the cluster and every sandbox are gone"
    # The killed workers' job folders too, swept by the jobs that came after.
    assert not list(tmp_path.glob("fastdl-*"))

    # The same inputs and seed, graded again one by one: the same scores.
    again = ["honest-0000", "honest-0003", "crashes-0000", "not-json-0005", "deletes-test-0007", "links-to-another-0006"]
    batch.grade(course, [(LAB, s) for s in again], profile=_cpu(cpu), seed=SEED, execute=False, only=[ITEM])
    assert _scores(course, again) == {s: scores[s] for s in again}


@pytest.mark.slow
def test_an_interrupted_run_resumes_where_it_stopped(course, cpu, tmp_path, monkeypatch):
    copy = copy_build(course, tmp_path / "course")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    students = [f"s{i}" for i in range(6)]
    for s in students:
        make_submission(copy, LAB, s, reference_solutions(copy, LAB))
    argv = [sys.executable, "-m", "autograder", "--course", str(copy.root), "autograde", LAB, "--profile", "cpu",
            "--seed", str(SEED), "--engine-only", "--item", ITEM, "--workers", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = list((copy.root / "runs").glob("*.jsonl"))
            if logs and sum('"final"' in line for line in logs[0].read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    first = journal.load(logs[0])
    assert 2 <= len(first.final) < len(students), "killed part-way"

    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        assert cli.main(["--course", str(copy.root), "autograde", LAB, "--resume", "--workers", "1"]) == 0
    finally:
        sys.stdout = sys_stdout
    assert f"resuming run {first.run_id}: {len(first.final)} of 6 already graded" in out.getvalue()
    events = [json.loads(line) for line in logs[0].read_text().splitlines() if '"final"' in line]
    # The finished ones were not graded again; the rest were graded once, with the run's seed and item.
    assert sorted(e["student"] for e in events) == students
    for s in students:
        record = json.loads((copy.records / LAB / f"{s}.json").read_text())
        assert record["seed"] == SEED and [i["item"] for i in record["items"]] == [ITEM]
        assert record["items"][0]["status"] == "passed"
    assert journal.latest_unfinished(copy.root, {LAB}) is None
    # The killed run's job folder went with the first job of the resumed one.
    assert not list(scratch.glob("fastdl-*"))


def test_a_grader_fault_is_named_and_the_batch_goes_on(course, cpu, tmp_path, monkeypatch):
    copy = copy_build(course, tmp_path / "course")
    for s in ("first", "second"):
        make_submission(copy, LAB, s, None)
    real = batch.grade_job

    def faulty(spec):
        return real(spec) if spec.student == "second" else {**real(spec), "error": "grader fault: OSError: disk full"}

    monkeypatch.setattr(batch, "grade_job", faulty)
    summary = batch.grade(copy, [(LAB, "first"), (LAB, "second")], profile=cpu, seed=SEED, execute=False)
    first, second = summary.graded[(LAB, "first")], summary.graded[(LAB, "second")]
    lost = [i for i in first["items"] if i["status"] == journal.NOT_GRADED]
    assert lost and all("disk full" in i["reason"] and i["counted"] for i in lost)
    assert len(lost) == len(first["items"])  # lab 00 has no item left out on a CPU profile
    assert {i["status"] for i in second["items"]} <= {"unanswered", "needs_gpu"}
    run = journal.load(copy.root / "runs" / f"{summary.run_id}.jsonl")
    assert run.final[(LAB, "first")]["state"] == journal.NOT_GRADED and not run.remaining
    assert any("first: not graded" in f for f in summary.failures)


def test_a_lost_job_leaves_out_what_the_profile_leaves_out(cpu):
    lab = load_lab("01_gemm")
    items = batch._lost_items(lab, cpu, "grader fault: OSError: disk full", None)
    left_out = {i["item"] for i in items if i["status"] == "needs_gpu"}
    assert left_out and left_out == {it.name for it in lab.items if it.is_speed}
    assert all(not i["counted"] for i in items if i["item"] in left_out)
    assert all(i["status"] == journal.NOT_GRADED and i["counted"] and "disk full" in i["reason"]
               for i in items if i["item"] not in left_out)
    # Its maximum is that of a graded record on this profile: the 10 points of lab 01 on the CPU.
    assert sum(i["max_score"] for i in items if i["counted"]) == 10
    on_gpu = batch._lost_items(lab, {**cpu, "gpu": True}, "lost", None)
    assert all(i["status"] == journal.NOT_GRADED and i["counted"] for i in on_gpu)


def test_regrading_some_items_keeps_the_other_verdicts_with_their_seed(course, cpu, tmp_path):
    copy = copy_build(course, tmp_path / "course")
    cells = reference_solutions(copy, LAB)
    make_submission(copy, LAB, "ann", cells)
    path = copy.records / LAB / "ann.json"
    batch.grade(copy, [(LAB, "ann")], profile=cpu, seed=SEED, execute=False)
    full = json.loads(path.read_text())
    assert len(full["items"]) > 1 and full["seed"] == SEED

    summary = batch.grade(copy, [(LAB, "ann")], profile=cpu, seed=SEED + 1, execute=False, only=[ITEM])
    again = json.loads(path.read_text())
    assert again["seed"] == SEED + 1 and not summary.failures
    assert [i["item"] for i in again["items"]] == [i["item"] for i in full["items"]]
    for before, after in zip(full["items"], again["items"]):
        if before["item"] == ITEM:
            assert after["status"] == "passed" and "seed" not in after
        else:
            assert after == {**before, "seed": SEED}
    totals = {(r["item"]): (r["score"], r["max_score"]) for r in pipeline.report_rows(copy) if r["student"] == "ann"}
    assert totals == {i["item"]: (i["score"], i["max_score"]) for i in full["items"]}

    # A new version of the notebook: verdicts on the old one are not carried over as they were.
    edited = dict(cells)
    other = next(name for name in edited if name != ITEM)
    edited[other] += "\n# edited after grading\n"
    make_submission(copy, LAB, "ann", edited)
    summary = batch.grade(copy, [(LAB, "ann")], profile=cpu, seed=SEED + 1, execute=False, only=[ITEM])
    last = {i["item"]: i for i in json.loads(path.read_text())["items"]}
    assert last[ITEM]["status"] == "passed"
    stale = [name for name, i in last.items() if name != ITEM and i["counted"]]
    assert stale and all(last[n]["status"] == journal.NOT_GRADED and last[n]["score"] == 0 and
                         "regrade the whole submission" in last[n]["reason"] for n in stale)
    assert any("not graded: the submission changed" in f for f in summary.failures)
    # The gradebook says what the record says: the stale items score nothing there either.
    from nbgrader.api import Gradebook

    with Gradebook(copy.db_url) as gb:
        for name in stale:
            grade = gb.find_grade(name, LAB, LAB, "ann")
            assert grade.auto_score == 0 and grade.manual_score == 0, name
        assert gb.find_submission(LAB, "ann").score == pytest.approx(last[ITEM]["score"])


def test_a_cpu_profile_is_not_graded_where_tritons_interpreter_is_broken(course, cpu, tmp_path, monkeypatch, capsys):
    from autograder import jobs
    from fastdl_lab import device

    copy = copy_build(course, tmp_path / "course")
    make_submission(copy, LAB, "first", None)
    broken = "Triton 3.6.0 with NumPy 2.4.6: Triton's interpreter ... fails; install 'numpy<2.4'"
    monkeypatch.setattr(device, "interpreter_problem", lambda: broken)
    # Every kernel item would grade as the student's error: nothing is graded, nothing is recorded.
    with pytest.raises(device.InterpreterBroken, match="numpy<2.4"):
        batch.grade(copy, [(LAB, "first")], profile=cpu, seed=SEED, execute=False)
    assert not list((copy.root / "runs").glob("*.jsonl")) and not copy.records.exists()
    assert cli.main(["--course", str(copy.root), "autograde", LAB, "--workers", "1"]) == 2
    assert "cannot grade on a CPU profile: " + broken in capsys.readouterr().err
    # A worker of a cluster checks its own: the job ends as the grader's fault, with the reason.
    spec = jobs.JobSpec(str(copy.root), "", LAB, "first", cpu, SEED, execute=False)
    assert "InterpreterBroken: " + broken in jobs.grade_job(spec)["error"]
    # A GPU profile runs compiled kernels: the interpreter is not asked.
    asked = []
    monkeypatch.setattr(device, "interpreter_problem", lambda: asked.append(1))
    summary = batch.grade(copy, [(LAB, "first")], profile={**cpu, "gpu": True}, seed=SEED, execute=False)
    assert (LAB, "first") in summary.graded and asked == []


def test_the_scratch_course_is_made_once_per_source_of_the_lab(course, tmp_path, monkeypatch):
    from autograder import jobs

    copy = copy_build(course, tmp_path / "course")
    made = []
    generate = jobs._generate_scratch
    monkeypatch.setattr(jobs, "_generate_scratch", lambda *a: (made.append(a[1]), generate(*a)))
    first = jobs.prepare_scratch(copy, LAB, tmp_path / "batch1")
    second = jobs.prepare_scratch(copy, LAB, tmp_path / "batch2")
    assert made == [LAB]
    for root in (first, second):
        assert (root / "gradebook.db").is_file() and (root / "release" / LAB).is_dir()
        # Each copy's config names its own folder and gradebook, not the kept one's.
        assert f"'{root}'" in (root / "nbgrader_config.py").read_text()
    source = copy.root / "source" / LAB / f"{LAB}.ipynb"
    source.write_text(source.read_text() + "\n")
    jobs.prepare_scratch(copy, LAB, tmp_path / "batch3")
    assert made == [LAB, LAB]
    assert len(list((copy.root / jobs.SCRATCH_CACHE).glob(f"{LAB}-*"))) == 1


def test_journal_survives_a_line_cut_short(tmp_path):
    run = journal.start(tmp_path, seed=7, profile="cpu", jobs=[("00_measure", "a"), ("00_measure", "b")],
                        options={"execute": False, "only": ["roofline"]})
    run.finish("00_measure", "a", journal.GRADED, score=4.0)
    with run.path.open("a") as f:
        f.write('{"event": "final", "lab": "00_measure", "stud')  # the kill came mid-write
    again = journal.load(run.path)
    assert again.remaining == [("00_measure", "b")] and again.seed == 7 and again.options["only"] == ["roofline"]
    assert journal.latest_unfinished(tmp_path, {"00_measure"}).run_id == run.run_id
    assert journal.latest_unfinished(tmp_path, {"01_gemm"}) is None
    with pytest.raises(ValueError):
        run.finish("00_measure", "b", "half-done")


def test_gpu_workers_each_see_one_gpu_and_declare_it():
    specs = batch.worker_specs(2, gpu=True)
    assert [s["options"]["env"]["CUDA_VISIBLE_DEVICES"] for s in specs.values()] == ["0", "1"]
    assert all(s["options"]["resources"] == {"GPU": 1} and s["options"]["nthreads"] == 1 for s in specs.values())
    assert all("resources" not in s["options"] for s in batch.worker_specs(2, gpu=False).values())
    assert batch.default_workers({"gpu": False}) == os.cpu_count()


def test_progress_prints_a_line_per_submission_when_not_a_terminal():
    stream = io.StringIO()
    bar = progress.Progress(2, stream=stream)
    graded = {"lab": LAB, "student": "ann\x1b[2J", "seconds": {"total": 3.25},
              "items": [{"item": "roofline", "score": 4.0, "max_score": 4, "status": "passed", "counted": True},
                        {"item": "speed", "score": 0.0, "max_score": 2, "status": "needs_gpu", "counted": False}]}
    lost = {"lab": LAB, "student": "bob", "seconds": {},
            "items": [{"item": "roofline", "score": 0.0, "max_score": 4, "status": "not_graded", "counted": True,
                       "reason": "the grading worker died"}]}
    bar(1, 2, graded)
    bar(2, 2, lost)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines == [f"[1/2] {LAB} ann?[2J: 4/4 (2 points need a GPU) in 3.2 s",
                     f"[2/2] {LAB} bob: NOT GRADED (the grading worker died)"]
    summary = progress.summary_lines([graded, lost])
    # What could not be graded is said first: those items scored 0 through no fault of the student.
    assert summary[0].startswith("NOT GRADED: 1 item(s) of 1 submission(s)") and "the grading worker died" in summary[0]
    assert summary[1] == "2 submission(s): passed 1, needs_gpu 1, not_graded 1"
    assert "1 not graded" in summary[2]
    assert progress.summary_lines([graded])[0].startswith("1 submission(s)")


def test_items_chosen_per_job_override_the_run_wide_choice_and_survive_the_journal(tmp_path):
    per_job = [["02_fusion", "buggy", ["softmax_fp32"]]]
    items = batch._selection(["conv_bn_fold"], per_job)
    assert items("02_fusion", "buggy") == ("softmax_fp32",)
    assert items("02_fusion", "other") == ("conv_bn_fold",)
    assert batch._selection(None, [])("02_fusion", "other") is None
    run = journal.start(tmp_path, seed=1, profile="cpu", jobs=[("02_fusion", "buggy")],
                        options={"only": None, "only_per_job": per_job})
    assert journal.load(run.path).options["only_per_job"] == per_job
