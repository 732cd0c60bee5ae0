"""The nbgrader course under ``build/course``: source notebooks, release, submissions, gradebook.

``labs/*.py`` (jupytext percent, the only committed form of a notebook) become nbgrader source
notebooks; ``nbgrader generate_assignment`` makes the student release; the package is copied for
students with its solution regions stubbed (``student_package/``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
from sqlalchemy.engine import make_url

from autograder import gradebook, records
from autograder.strip import strip_package

ROOT = Path(__file__).resolve().parent.parent
COURSE_ID = "fastdl-lab"
# Triton kernels are compiled on first call (seconds under the interpreter, longer on a cold
# GPU cache), and lab cells time things: the per-cell budget is sized for that.
CELL_TIMEOUT_S = 300

SOLUTION_DEFAULTS = {"grade": False, "locked": False, "schema_version": 3, "solution": True, "task": False}
TEST_DEFAULTS = {"grade": True, "locked": True, "schema_version": 3, "solution": False, "task": False}

CONFIG = """\
# Written by `python -m autograder build`; edit autograder/course.py instead.
from autograder.execute import autograde_preprocessors
from autograder.formgrader import TrustedAutograde
from autograder import feedback_html
from autograder.feedback import ClearHiddenTestsInTestCells, TrustedVerdicts
from nbgrader.preprocessors import GetGrades
from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor

c = get_config()
c.CourseDirectory.course_id = {course_id!r}
c.CourseDirectory.root = {root!r}
c.CourseDirectory.db_url = {db_url!r}
c.ClearSolutions.code_stub = {{"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}}
c.Execute.timeout = {timeout}
c.Execute.interrupt_on_timeout = True
c.Execute.allow_errors = True
# The student's notebook is student code: its kernel starts in the grader's sandbox.
c.Execute.kernel_manager_class = "autograder.engine.kernel_jail.JailedKernelManager"
{autograde}
# A test cell a student deleted comes back from the source; the trusted engine still costs it.
c.OverwriteCells.add_missing_cells = True
c.ClearHiddenTests.enforce_metadata = False
c.GenerateFeedback.preprocessors = [ClearHiddenTestsInTestCells, TrustedVerdicts, GetGrades, CSSHTMLHeaderPreprocessor]
# Feedback pages that call no one: math as MathML, no MathJax from a CDN (autograder/feedback_html.py).
c.GenerateFeedback.exporter_class = "autograder.feedback_html.OfflineFeedbackExporter"
c.HTMLExporter.template_name = feedback_html.TEMPLATE_NAME
c.HTMLExporter.extra_template_basedirs = [str(feedback_html.TEMPLATES), str(feedback_html.NBGRADER_TEMPLATES)]
c.TrustedVerdicts.records_dir = {records!r}
"""

# In the course, nbgrader's autograde (formgrader's button, `nbgrader autograde`) is the trusted
# pipeline; in a grading job's scratch course it is the sandboxed run of the notebook the pipeline
# starts (autograder/jobs.py), which must not start the pipeline again.
COURSE_AUTOGRADE = """\
# nbgrader's autograde runs the trusted pipeline (autograder/formgrader.py): the engine's verdicts are the scores.
c.Autograde.autograde_preprocessors = autograde_preprocessors(execute=TrustedAutograde, save=None)
c.TrustedAutograde.course_root = {root!r}
"""
SCRATCH_AUTOGRADE = """\
# The trusted engine grades every test cell's item: nbgrader's run executes the other cells only.
c.Autograde.autograde_preprocessors = autograde_preprocessors()
"""


@dataclasses.dataclass(frozen=True)
class Course:
    root: Path
    # The gradebook's SQLAlchemy URL. None: FASTDL_GRADEBOOK_URL where set, else the SQLite file
    # in the course folder. Fixed when the course is made, so every command of one run agrees.
    db_url: str | None = None

    def __post_init__(self):
        # nbgrader runs with the course folder as its working directory and the paths in its
        # config are read from there, so a relative root would point elsewhere. Links are resolved
        # here, once: past the root, a submission is read only through real folders (notebook.py).
        object.__setattr__(self, "root", Path(self.root).expanduser().resolve())
        url = self.db_url or os.environ.get(gradebook.URL_VAR) or self.sqlite_url
        object.__setattr__(self, "db_url", gradebook.with_driver(url))

    def __repr__(self) -> str:
        # Courses end up in assertion messages and logs; the URL's password must not.
        return f"Course(root={str(self.root)!r}, db_url={gradebook.masked(self.db_url)!r})"

    @classmethod
    def default(cls, db_url: str | None = None) -> "Course":
        return cls(Path(os.environ.get("FASTDL_COURSE_DIR", ROOT / "build" / "course")), db_url)

    @property
    def sqlite_url(self) -> str:
        """The gradebook file in the course folder, the default."""
        return f"sqlite:///{self.root / 'gradebook.db'}"

    def sqlite_file(self) -> Path | None:
        """The gradebook's file if it is SQLite; a relative path is read from the course folder,
        where nbgrader runs."""
        url = make_url(self.db_url)
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        return self.root / url.database

    def check_gradebook(self) -> None:
        """Raise ``gradebook.GradebookUnavailable`` (a named reason, no password) unless the
        gradebook's server answers: called before anything is built or graded."""
        gradebook.check(self.db_url)

    def source(self, lab: str) -> Path:
        return self.root / "source" / lab / f"{lab}.ipynb"

    def release(self, lab: str) -> Path:
        return self.root / "release" / lab / f"{lab}.ipynb"

    def submitted(self, student: str, lab: str) -> Path:
        return self.root / "submitted" / student / lab / f"{lab}.ipynb"

    def autograded(self, student: str, lab: str) -> Path:
        return self.root / "autograded" / student / lab / f"{lab}.ipynb"

    def feedback_dir(self, student: str, lab: str) -> Path:
        return self.root / "feedback" / student / lab

    @property
    def student_package(self) -> Path:
        return self.root / "student_package"

    @property
    def records(self) -> Path:
        return self.root / "records"

    def students(self, lab: str) -> list[str]:
        """Everyone with an entry for ``lab``, links and odd files included: grading refuses
        those with a named reason rather than leaving the student out unseen."""
        base = self.root / "submitted"
        return sorted(p.name for p in base.iterdir() if os.path.lexists(p / lab)) if base.exists() else []

    def nbgrader(self, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        """Run one nbgrader command in the course folder; the caller decides what failure means."""
        argv = [sys.executable, "-m", "autograder.nbgrader_main", *args]
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout,
                              env=tool_env())


def tool_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with this interpreter's bin folder first on PATH: nbgrader
    runs ``alembic`` by name, and a venv's python run by its path has not put its bin on PATH."""
    env = dict(os.environ if env is None else env)
    # Not resolved: a venv's python is a link to the base interpreter, whose bin has no alembic.
    bin_dir = str(Path(sys.executable).parent)
    parts = env.get("PATH", "").split(os.pathsep) if env.get("PATH") else []
    env["PATH"] = os.pathsep.join([bin_dir, *(p for p in parts if p != bin_dir)])
    return env


def lab_sources() -> dict[str, Path]:
    """The registered labs (a grading spec under autograder/labs) and their jupytext files. A
    registered lab without its file is an error; a file no spec registers is not a lab."""
    from autograder.engine.items import all_labs

    sources = {name: ROOT / "labs" / f"{name}.py" for name in all_labs()}
    missing = [str(path.relative_to(ROOT)) for path in sources.values() if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"registered lab(s) without their notebook file: {', '.join(missing)}")
    return sources


def stray_lab_files() -> list[Path]:
    """Files in labs/ that look like a lab but that no grading spec registers (a scratch copy such
    as 'labs/01_gemm copy.py'): never built, released or graded."""
    registered = set(lab_sources().values())
    return sorted(p for p in (ROOT / "labs").glob("[0-9][0-9]_*.py") if p not in registered)


def to_nbgrader_notebook(path: Path) -> nbformat.NotebookNode:
    """Read a jupytext lab and complete the short nbgrader metadata written in its cell headers."""
    nb = jupytext.read(path)
    ids = set()
    for cell in nb.cells:
        cell.metadata.pop("lines_to_next_cell", None)
        meta = cell.metadata.get("nbgrader")
        if not meta:
            continue
        grade_id = meta.get("grade_id")
        if not grade_id or grade_id in ids:
            raise ValueError(f"{path.name}: graded cell without a unique grade_id: {meta}")
        ids.add(grade_id)
        defaults = SOLUTION_DEFAULTS if meta.get("solution") else TEST_DEFAULTS
        cell.metadata["nbgrader"] = {**defaults, **meta}
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata.pop("jupytext", None)
    return nb


def write_config(course: Course, *, scratch: bool = False) -> None:
    """The course's ``nbgrader_config.py``; ``scratch``: the config of a grading job's scratch course,
    whose autograde only executes the notebook."""
    course.root.mkdir(parents=True, exist_ok=True)
    config = course.root / "nbgrader_config.py"
    if gradebook.has_password(course.db_url):
        # nbgrader's own commands need the URL as given; only its owner may read it then.
        config.touch()
        config.chmod(0o600)
    config.write_text(
        CONFIG.format(
            course_id=COURSE_ID, root=str(course.root), db_url=course.db_url,
            timeout=CELL_TIMEOUT_S, records=str(course.records),
            autograde=(SCRATCH_AUTOGRADE if scratch else COURSE_AUTOGRADE).format(root=str(course.root)),
        )
    )


def _first_missing(path: Path, root: Path) -> Path:
    """The outermost folder of ``path``'s parents, below ``root``, that does not exist yet."""
    missing = path.parent
    while missing.parent != root and not missing.parent.exists():
        missing = missing.parent
    return missing


def build(course: Course, labs: list[str] | None = None) -> list[str]:
    """Make the source notebooks, the student release and the student copy of the package.

    A build that fails takes back what it created (the course folder, its gradebook file, the
    failing lab's folders), so the next build starts from a clean state, not a half-made gradebook.
    A lab that has grades keeps the maxima of its grading records (``gradebook.restore_maxima``)."""
    from autograder.engine.items import load_lab

    sources = lab_sources()
    unknown = sorted(set(labs or ()) - set(sources))
    if unknown:
        raise ValueError(f"unknown lab(s) {', '.join(unknown)}; registered labs: {', '.join(sources)}")
    for stray in stray_lab_files():
        print(f"warning: {stray.relative_to(ROOT)} is not a registered lab (no spec in autograder/labs): "
              "left out of the course", file=sys.stderr)
    created = [p for p in (course.root, course.sqlite_file(), course.root / "nbgrader_config.py")
               if p is not None and not os.path.lexists(p)]
    built: list[str] = []
    try:
        write_config(course)
        for lab, path in sources.items():
            if labs and lab not in labs:
                continue
            created += [_first_missing(p, course.root) for p in (course.source(lab), course.release(lab))
                        if not p.parent.exists()]
            target = course.source(lab)
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(to_nbgrader_notebook(path), target)
            done = course.nbgrader("generate_assignment", lab, "--force", "--CourseDirectory.create_assignment=True")
            if done.returncode != 0:
                raise RuntimeError(f"nbgrader generate_assignment {lab} failed:\n{done.stdout}\n{done.stderr}")
            # nbgrader has just set every test cell back to the notebook's points; a lab with grades
            # keeps the maxima its grading gave them (items the profile left out stay worth 0).
            for note in gradebook.restore_maxima(course.db_url, load_lab(lab), records.read_lab(course.records, lab)):
                print(note, file=sys.stderr)
            built.append(lab)
        strip_package(ROOT / "fastdl_lab", course.student_package / "fastdl_lab")
        compile_package(course.student_package / "fastdl_lab")
    except BaseException:
        for path in reversed(created):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        raise
    return built


def compile_package(package: Path) -> None:
    """Byte-compile the student package where it lies. Every grading child and every nbgrader kernel
    imports it from a read-only mount with PYTHONDONTWRITEBYTECODE set, so without these files each
    of them compiles the modules it imports from source, again. Python checks each file against its source's size and modification time, which
    copies of the course keep (``copy_build``); a stale one is ignored, never used."""
    import compileall

    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        compiled = compileall.compile_dir(str(package), quiet=1, workers=1)
    if not compiled:
        raise RuntimeError(f"the student package does not compile:\n{output.getvalue()[-2000:]}")


def copy_build(course: Course, root: Path) -> Course:
    """The build of ``course`` (source, release, student package, and the gradebook that knows the
    assignments) in a new folder, without the submission folders or records: a second grader
    process can work there at the same time, since each SQLite gradebook must keep to one writer.

    The copy's gradebook is always a SQLite file of its own, whatever the environment says. The
    copy of a course on PostgreSQL gets the rows of its database in that file rather than the same
    database: a copy is graded apart (a trial, a worker whose results are read from its copy), and
    grades written there must not land in the real course's gradebook."""
    copy = Course(root)
    copy = dataclasses.replace(copy, db_url=copy.sqlite_url)
    for part in ("source", "release", "student_package"):
        shutil.copytree(course.root / part, copy.root / part, symlinks=True)
    source_file = course.sqlite_file()
    if source_file is not None:
        shutil.copyfile(source_file, copy.root / "gradebook.db")
    else:
        (copy.root / "gradebook.db").unlink(missing_ok=True)
        gradebook.copy(course.db_url, copy.db_url)
    write_config(copy)
    return copy
