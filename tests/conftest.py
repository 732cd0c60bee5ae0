import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# The processes the tests start (nbgrader, its kernel manager, notebook kernels) import this
# checkout's packages, not those of whichever clone the virtual environment was installed from.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))

# Keep every cache inside the project even when pytest is run directly rather than through make.
_CACHE = _ROOT / "build" / "cache"
for _var, _sub in {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "JUPYTER_RUNTIME_DIR": "jupyter/runtime",
    "JUPYTER_DATA_DIR": "jupyter/data",
    "JUPYTER_CONFIG_DIR": "jupyter/config",
    "IPYTHONDIR": "ipython",
    "MPLCONFIGDIR": "matplotlib",
}.items():
    os.environ.setdefault(_var, str(_CACHE / _sub))
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402

import e2e_times  # noqa: E402
from progress_lines import Lines, runs_e2e  # noqa: E402


# The files that grade the demo class (the longest fixture) run first, so that with several
# workers (make test) the other files share the rest of the time.
FIRST = ("test_grading_pipeline.py",)


def pytest_collection_modifyitems(config, items):
    import torch

    items.sort(key=lambda item: item.path.name not in FIRST)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def course(tmp_path_factory, request):
    """One built course (every lab's source, release and student package) for the whole session.

    With several xdist workers (make test) the first to come builds it once, in the run's folder
    they share, and each worker grades in a copy of its own (``copy_build``: a SQLite gradebook
    keeps to one writer): a build is about 30 s on the 2-core machine, a copy a fraction of a second."""
    from autograder.course import Course, build, copy_build

    say = Lines(request.config, "course", e2e_times.COURSE_BUILD, on=runs_e2e(request.session))
    say("building every lab's source, release and student package")
    course = Course(tmp_path_factory.mktemp("course"))
    if not hasattr(request.config, "workerinput") or course.sqlite_file() is None:
        build(course)
        say("built")
        return course
    shared = Course(tmp_path_factory.getbasetemp().parent / "course-build")
    with open(shared.root.parent / "course-build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its worker dies
        built = shared.root / ".built"
        if not built.exists():
            shutil.rmtree(shared.root, ignore_errors=True)  # a worker that died half-way
            build(shared)
            built.touch()
    say("built")
    return copy_build(shared, course.root)


@pytest.fixture(scope="session")
def cpu():
    from autograder import profiles

    return profiles.load("cpu")


DEMO_SEED = 1234
# Grading one submission keeps about one core busy (nbgrader's kernel, then the engine's children).
DEMO_WORKERS = 2


@dataclass
class Demo:
    course: object  # the autograder.course.Course this lab was graded in
    summary: object  # its autograder.pipeline.LabSummary
    executed: frozenset  # the students whose notebook nbgrader ran


# nbgrader's run of a notebook is the student's own record for formgrader and the feedback, not
# the grade, and most of a submission's grading time: the demo runs it for each lab's reference,
# the buggy feedback the tests read and, in a session with the browser tests, every submission of
# lab 00 (formgrader's list); the engine grades every submission. Those it does not execute are
# graded on the items their mistake can reach (the others grade as the reference does).
def demo_executed(lab: str, student: str, browser: bool) -> bool:
    return (student == "reference" or (browser and lab == "00_measure")
            or (lab, student) == ("01_gemm", "buggy-k-remainder"))


@pytest.fixture(scope="session")
def demo(course, cpu, tmp_path_factory, request):
    """The demo students of every lab, graded in one course on a local cluster of DEMO_WORKERS
    workers (autograder/batch.py): {lab: Demo}. Shared by the pipeline and browser tests, so that a
    session grades the class once."""
    from autograder import batch, pipeline
    from autograder.course import copy_build
    from autograder.engine.items import all_labs
    from autograder.progress import describe
    from autograder.submissions import demo_students, demo_targets

    say = Lines(request.config, "demo class", e2e_times.DEMO_CLASS, on=runs_e2e(request.session))
    copy = copy_build(course, tmp_path_factory.mktemp("demo"))
    # Labs that compile the student's source take longest: they go first, so that no worker is left
    # with one at the end.
    labs = sorted(all_labs().values(), key=lambda lab: -max(item.build_s for item in lab.items))
    jobs = [(lab.name, student) for lab in labs for student in demo_students(copy, lab.name)]
    browser = any(item.get_closest_marker("browser") for item in request.session.items)
    executed = {job for job in jobs if demo_executed(*job, browser)}
    say(f"grading {len(jobs)} submissions of {len(labs)} labs on {DEMO_WORKERS} workers, "
        f"nbgrader's run of the notebook for {len(executed)} of them first")
    cluster = batch.local_cluster(DEMO_WORKERS, gpu=False)
    try:
        targeted = [[lab, student, demo_targets(lab, student)] for lab, student in jobs
                    if (lab, student) not in executed and demo_targets(lab, student)]
        runs = []
        for execute in (True, False):
            before = 0 if execute else len(executed)

            # The batch's own progress callback: a line per submission, as autograde's log has it,
            # counted across both runs.
            def progress(done, _total, record, before=before):
                say(f"[{before + done}/{len(jobs)}] {describe(record)}")

            runs.append(batch.grade(copy, [job for job in jobs if (job in executed) == execute], profile=cpu,
                                    seed=DEMO_SEED, scheduler=cluster.scheduler_address, execute=execute,
                                    only_per_job=None if execute else targeted, progress=progress,
                                    stage=say))
    finally:
        cluster.close()
    say(f"done: {len(jobs)} submissions graded")
    done = batch.BatchSummary(jobs=[job for run in runs for job in run.jobs],
                              failures=[f for run in runs for f in run.failures],
                              seconds={job: s for run in runs for job, s in run.seconds.items()})
    return {lab.name: Demo(copy, pipeline.lab_summary(lab.name, done),
                           frozenset(student for lab_name, student in executed if lab_name == lab.name))
            for lab in labs}
