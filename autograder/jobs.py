"""One grading job: one student's submission of one lab, graded where a worker runs it.

A job runs nbgrader's autograde of the notebook (the student's own test run, kept for formgrader
and feedback) beside the trusted engine's items, and hands back everything it found as plain data: the
executed notebook, nbgrader's automatic scores and the engine's verdicts. It writes nothing in the
course: the process that collects the results is the only writer of the records, the autograded
folder and the gradebook, so any number of jobs can run at once, on this machine or on a cluster
whose workers see the course folder.

nbgrader keeps a gradebook of its own while it runs; each job gives it a private copy of the lab's
scratch course (``prepare_scratch``: one per source of the lab, kept in the course), with a SQLite
gradebook of its own.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autograder import notebook, records, workfolder
from autograder.course import Course, tool_env, write_config
from autograder.engine import bwrap, kernel_jail, prefork
from autograder.engine.grade import attempt_digest, grade_submission, student_seed
from autograder.engine.items import load_lab
from autograder.engine.sandbox import Limits, run_sandboxed
from fastdl_lab import device

# nbgrader executes the student's notebook in a kernel of its own, which starts in the sandbox
# (kernel_jail). nbgrader itself runs under these limits in a private network namespace, which
# the kernel shares (loopback stays up between them): a fork bomb, a memory hog or a process
# left behind in the notebook cannot outlive the run or reach the network.
NBGRADER_LIMITS = Limits(wall_s=1800, cpu_s=3600, memory_bytes=12 << 30, limit_address_space=False,
                         max_processes=48, output_bytes=4 << 20, loopback=True)


@dataclass(frozen=True)
class JobSpec:
    """What a worker needs to grade one submission; plain data, so it travels to any worker."""
    course_root: str
    scratch: str  # the lab's scratch course from prepare_scratch
    lab: str
    student: str
    profile: dict
    seed: int  # the batch's seed; each student's is derived from it
    cell_timeout: int | None = None
    isolated: bool = True
    execute: bool = True  # False: the engine alone (nbgrader does not run the notebook)
    only: tuple[str, ...] | None = None  # grade these items only
    item_parallel: int = 2


@dataclass
class JobResult:
    lab: str
    student: str
    items: list[dict] = field(default_factory=list)
    nbgrader: dict = field(default_factory=dict)  # returncode, message, outputs_cut
    autograded: str | None = None  # the executed notebook (JSON text), outputs capped
    auto_grades: dict = field(default_factory=dict)  # grade cell -> nbgrader's automatic score
    auto_comments: dict = field(default_factory=dict)  # comment cell -> nbgrader's automatic comment
    seconds: dict = field(default_factory=dict)  # nbgrader, engine, total
    worker: str = ""
    error: str = ""  # the job itself failed (a grader fault, never the student's doing)
    attempt: str = ""  # the digest of the submission's solution cells, part of its inputs' seed

    def as_dict(self) -> dict:
        return asdict(self)


def nbgrader_env(student_package: Path, profile: dict, isolated: bool) -> dict[str, str]:
    """nbgrader's own environment. Its jailed kernel starts from ``bwrap.environment`` alone, but an
    unisolated kernel inherits this one, so what decides where kernels run is set here as for a
    grading child (``bwrap.device_environment``), never inherited: a TRITON_INTERPRET=1 exported in
    the instructor's shell would otherwise make every launcher refuse CUDA tensors on a GPU host."""
    # Triton's switches change what a kernel does (TRITON_INTERPRET, TRITON_DEBUG, ...); its cache
    # folder only where it keeps what it compiled.
    env = {var: value for var, value in tool_env().items()
           if not var.startswith("TRITON_") or var == "TRITON_CACHE_DIR"}
    env.update(bwrap.device_environment(bool(profile.get("gpu"))))
    env[kernel_jail.STUDENT_PACKAGE_VAR] = str(student_package)
    # nbgrader's run is the student's own test record, not the grade: the notebook's ungraded
    # experiments need only run, at tiny sizes (fastdl_lab.device.quick). FASTDL_QUICK=0 in the
    # instructor's environment keeps them full size.
    env.setdefault(kernel_jail.QUICK_VAR, "1")
    # The run takes one of the engine's item slots (grade_job), and gets the threads an item's child
    # gets: with more, its kernel's thread pools and the items' fight over the same cores.
    env["OMP_NUM_THREADS"] = str(profile.get("threads", 1))
    env[kernel_jail.GPU_VAR] = "1" if profile.get("gpu") else "0"
    if not isolated:
        env[kernel_jail.UNSAFE_VAR] = "1"
    return env


def _nbgrader_run_env(student_package: Path, profile: dict, isolated: bool) -> dict[str, str]:
    """``nbgrader_env`` and what a jailed kernel is told: where the grader's inductor headers are, and
    the socket it asks for a warm kernel on (``prefork.kernel_relay``)."""
    env = nbgrader_env(student_package, profile, isolated)
    if isolated:  # an unisolated kernel shares this machine's /tmp, where inductor keeps it
        env.update(kernel_jail.headers_for_kernels(bool(profile.get("gpu"))))
        relay = None if profile.get("gpu") else prefork.kernel_relay()
        if relay:
            env[prefork.KERNEL_RELAY_VAR] = relay
    return env


def nbgrader_server(env: dict[str, str]) -> prefork.ForkServer | None:
    """The fork server nbgrader's runs with ``env`` start from, warm with nbgrader's imports; None
    where they start cold. A GPU host forks it too: nbgrader's process never touches CUDA."""
    return prefork.server_for(env, gpu=False, preload=prefork.NBGRADER_PRELOAD, trusted=True)


def start_nbgrader_servers(student_package: Path, profile: dict) -> None:
    """Start now, not at the first submission's notebook, the fork servers of this grading process
    that nbgrader's runs and their kernels are forked from."""
    nbgrader_server(_nbgrader_run_env(student_package, profile, isolated=True))
    if not profile.get("gpu") and prefork.kernel_relay():
        env = kernel_jail.kernel_env(False, nbgrader_env(student_package, profile, isolated=True))
        prefork.server_for(env, gpu=False, preload=prefork.KERNEL_PRELOAD)


def _write_scratch_config(root: Path) -> None:
    # Always a SQLite file of its own, whatever gradebook URL the course or the environment names.
    write_config(Course(root, f"sqlite:///{root / 'gradebook.db'}"), scratch=True)


# Prepared scratch courses, kept in the course folder between batches (see prepare_scratch).
SCRATCH_CACHE = ".scratch-cache"


def _scratch_key(course: Course, lab: str) -> str:
    """What a prepared scratch course depends on: the lab's source files, nbgrader's version and
    the config templates the scratch course is written from."""
    from importlib.metadata import version

    from autograder import course as course_module

    digest = hashlib.sha256()
    for part in (version("nbgrader"), course_module.CONFIG, course_module.SCRATCH_AUTOGRADE):
        digest.update(part.encode() + b"\0")
    source = course.root / "source" / lab
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _empty_gradebook(cache: Path) -> Path:
    """A new gradebook with no assignment in it, as nbgrader makes one: its tables, and the version
    of its schema, which nbgrader learns by starting ``alembic``, most of a scratch course's time
    (on the loaded 2-core machine, generate_assignment took 21-22 s with a new gradebook and 6-6.5 s
    with this one). Made once per nbgrader version and copied into each lab's scratch course."""
    from importlib.metadata import version

    kept = cache / f"empty-gradebook-{version('nbgrader')}.db"
    if kept.is_file():
        return kept
    making = Path(tempfile.mkdtemp(prefix=".empty-gradebook-", dir=cache))
    try:
        code = "import sys; from nbgrader.api import Gradebook; Gradebook('sqlite:///' + sys.argv[1]).close()"
        done = subprocess.run([sys.executable, "-c", code, str(making / "gradebook.db")], capture_output=True,
                              text=True, timeout=600, env=tool_env())
        if done.returncode != 0:
            raise RuntimeError(f"cannot make an empty gradebook for the scratch courses: {done.stderr[-1000:]}")
        for stale in cache.glob("empty-gradebook-*.db"):
            stale.unlink(missing_ok=True)
        # A rename, as for the scratch courses: no batch copies a half-written one.
        (making / "gradebook.db").rename(kept)
    finally:
        shutil.rmtree(making, ignore_errors=True)
    return kept


def _generate_scratch(course: Course, lab: str, root: Path) -> None:
    (root / "source").mkdir(parents=True)
    shutil.copytree(course.root / "source" / lab, root / "source" / lab)
    _write_scratch_config(root)
    shutil.copyfile(_empty_gradebook(course.root / SCRATCH_CACHE), root / "gradebook.db")
    argv = [sys.executable, "-m", "autograder.nbgrader_main", "generate_assignment", lab, "--force"]
    done = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600, env=tool_env())
    if done.returncode != 0:
        raise RuntimeError(f"cannot prepare the scratch course of {lab}: {done.stderr[-1000:]}")


def prepare_scratch(course: Course, lab: str, folder: Path) -> Path:
    """The lab's scratch course under ``folder``: its source notebook and a gradebook that knows the
    assignment.

    nbgrader's generate_assignment makes it once per source of the lab, in a copy of an empty
    gradebook made once (``_empty_gradebook``: dating a new one is most of the time). The result is kept
    under the course's ``.scratch-cache`` (this process and the instructor's alone write there)
    and copied for each batch; a changed source, nbgrader or config template makes a new one."""
    cache = course.root / SCRATCH_CACHE
    kept = cache / f"{lab}-{_scratch_key(course, lab)}"
    if not kept.is_dir():
        cache.mkdir(exist_ok=True)
        making = Path(tempfile.mkdtemp(prefix=f".{lab}-", dir=cache))
        try:
            _generate_scratch(course, lab, making / lab)
            for stale in cache.glob(f"{lab}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            # A rename: a batch never sees a half-made one, and of two made at once one is kept.
            try:
                (making / lab).rename(kept)
            except OSError:
                if not kept.is_dir():
                    raise
        finally:
            shutil.rmtree(making, ignore_errors=True)
    root = Path(folder) / lab
    shutil.copytree(kept, root)
    _write_scratch_config(root)
    return root


def _nbgrader_autograde(root: Path, spec: JobSpec, env: dict, as_released: bool = False) -> dict:
    argv = [sys.executable, "-m", "autograder.nbgrader_main", "autograde", spec.lab, "--student", spec.student, "--force"]
    if as_released:
        argv.append("--ExecuteUngradedCells.as_released=True")
    if spec.cell_timeout:
        argv.append(f"--Execute.timeout={spec.cell_timeout}")
    done = run_sandboxed(argv, limits=NBGRADER_LIMITS, cwd=str(root), env=env, server=nbgrader_server(env))
    message = ""
    if done.status not in ("ok", "error"):
        message = f"nbgrader autograde was stopped: {done.reason}"
    elif done.returncode != 0:
        lines = [ln for ln in done.output_tail.splitlines() if "ERROR" in ln or "Error" in ln]
        message = "nbgrader could not execute the notebook: " + (" | ".join(lines[-3:]) or f"exit code {done.returncode}")
    return {"returncode": done.returncode, "message": records.clean_reason(message)[:2000] if message else ""}


def _automatic_scores(root: Path, lab: str, student: str) -> tuple[dict, dict]:
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        try:
            nb = gb.find_submission_notebook(lab, lab, student)
        except MissingEntry:
            return {}, {}
        grades = {g.name: g.auto_score for g in nb.grades}
        comments = {c.name: c.auto_comment for c in nb.comments}
    return grades, comments


def _code_as_released(nb: dict, release: Path) -> bool:
    """Whether every code cell of ``nb`` is the release's, in order (sources compared as text)."""

    def code(notebook_dict: dict) -> list[str]:
        return ["".join(c.get("source") or "") if isinstance(c.get("source"), list) else str(c.get("source") or "")
                for c in notebook_dict.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "code"]

    try:
        return code(nb) == code(notebook.read_notebook(release))
    except (notebook.NotebookError, OSError):
        return False


def _run_nbgrader(spec: JobSpec, nb: dict, result: JobResult, work: Path) -> None:
    root = work / "course"
    shutil.copytree(spec.scratch, root)
    _write_scratch_config(root)
    target = root / "submitted" / spec.student / spec.lab / f"{spec.lab}.ipynb"
    target.parent.mkdir(parents=True)
    # What nbgrader reads is the notebook the engine read, copied: never the student's folder,
    # which could hold links to another student's work.
    target.write_text(json.dumps(nb), encoding="utf-8")
    env = _nbgrader_run_env(Path(spec.course_root) / "student_package", spec.profile, spec.isolated)
    as_released = _code_as_released(nb, Course(Path(spec.course_root)).release(spec.lab))
    result.nbgrader = _nbgrader_autograde(root, spec, env, as_released)
    if as_released:
        result.nbgrader["as_released"] = True
    executed = root / "autograded" / spec.student / spec.lab / f"{spec.lab}.ipynb"
    result.nbgrader["outputs_cut"] = notebook.cap_outputs(executed)
    if executed.is_file():
        result.autograded = executed.read_text(encoding="utf-8", errors="replace")
    result.auto_grades, result.auto_comments = _automatic_scores(root, spec.lab, spec.student)


def grade_job(spec: JobSpec) -> dict:
    """Grade one submission; returns ``JobResult.as_dict()``. Never raises: a fault of the grader
    itself comes back in ``error`` and the collecting process records it by name.

    nbgrader's run of the notebook takes one of the engine's item slots (``run_items``), beside
    the items and before any speed item: a submission's wall time is about the longer of the two,
    not their sum, and no more processes run at once than the items alone would start."""
    started = time.monotonic()
    result = JobResult(spec.lab, spec.student, worker=socket.gethostname())
    course = Course(Path(spec.course_root))
    submitted = course.submitted(spec.student, spec.lab)
    try:
        # Those of jobs whose worker was killed: only a later job on the machine can remove them.
        workfolder.remove_abandoned()
        with workfolder.job_folder() as work:
            _grade_in(spec, course, submitted, work, result, started)
    except OSError as exc:  # the folder could not be made: _grade_in names every fault of its own
        result.error = records.clean_reason(f"grader fault: no work folder: {exc}")
        result.seconds = {"total": round(time.monotonic() - started, 2)}
    return result.as_dict()


def _grade_in(spec: JobSpec, course: Course, submitted: Path, work: Path, result: JobResult, started: float) -> None:
    nbgrader_s = 0.0

    def run_nbgrader() -> None:
        nonlocal nbgrader_s
        nb_started = time.monotonic()
        try:
            # nbgrader follows links and reads any size: a submission the engine refuses
            # never reaches it.
            _run_nbgrader(spec, notebook.read_notebook(submitted), result, work)
        except notebook.NotebookError as exc:
            result.nbgrader = {"returncode": None, "message": records.clean_reason(f"not given to nbgrader: {exc}")}
        nbgrader_s = time.monotonic() - nb_started

    try:
        if not spec.execute:
            result.nbgrader = {"returncode": None, "message": "", "skipped": "graded by the engine alone"}
        if not spec.profile.get("gpu"):
            # A worker of a cluster may have another Triton or NumPy than the grader that checked
            # its own: a broken interpreter is the worker's fault, never the student's.
            device.check_interpreter()
        lab = load_lab(spec.lab)
        engine_started = time.monotonic()
        result.attempt = attempt_digest(submitted)
        verdicts = grade_submission(
            lab, submitted, release=course.release(spec.lab), profile=spec.profile,
            seed=student_seed(spec.seed, lab.name, spec.student, result.attempt), student_package=course.student_package,
            isolated=spec.isolated, parallel=spec.item_parallel, only=set(spec.only) if spec.only else None,
            alongside=run_nbgrader if spec.execute else None, scratch=work,
        )
        result.items = [v.as_dict() for v in verdicts]
        done = time.monotonic()
        # The two overlap: the engine's seconds include nbgrader's run beside its items, and the
        # total is less than their sum.
        result.seconds = {"nbgrader": round(nbgrader_s, 2), "engine": round(done - engine_started, 2),
                          "total": round(done - started, 2)}
    except Exception:  # noqa: BLE001 - a grader fault must not take the batch down; it is named
        result.error = records.clean_reason("grader fault: " + traceback.format_exc(limit=4).strip().splitlines()[-1])
        result.seconds = {"total": round(time.monotonic() - started, 2)}
