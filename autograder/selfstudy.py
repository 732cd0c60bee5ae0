"""Student mode: the learner's working folder and a kernel that sees only the student package.

``make lab`` opens working copies of the *release* notebooks (no solutions, no hidden tests) in
``work/`` (``FASTDL_WORK_DIR``), outside the tracked tree and outside ``build/``, so that neither
git nor ``make clean`` touches the learner's work. A copy is made once, when it is missing, and
never overwritten. Its kernel is ``fastdl-student``: it imports the student copy of ``fastdl_lab``
(solution regions stubbed) and cannot import the repository's package or the grader.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat

from autograder.course import ROOT, Course, build, lab_sources
from autograder.strip import strip_package

WORK_VAR = "FASTDL_WORK_DIR"
KERNEL_NAME = "fastdl-student"
KERNEL_DISPLAY = "Python 3 (fastdl-lab, student package)"
# JupyterLab's settings in self-study (nbgrader's Validate only, no news, the student kernel started
# on opening a notebook), the only folder on JUPYTER_CONFIG_PATH: a learner's own settings in
# JUPYTER_CONFIG_DIR still apply on top.
SETTINGS = ROOT / "deploy" / "jupyter" / "selfstudy"

# The kernel's launcher. The editable install puts the repository root on every interpreter's
# path (a .pth file): there, `fastdl_lab` would be the package with its solutions and
# `autograder` the grader with its hidden checks. The launcher takes the root off the path before
# ipykernel starts, so only the student copy named by PYTHONPATH can be imported.
LAUNCHER = """\
import os
import sys

_hidden = {hidden!r}
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != _hidden and p != os.path.dirname(__file__)]

from ipykernel import kernelapp

kernelapp.launch_new_instance()
"""


def work_dir() -> Path:
    return Path(os.environ.get(WORK_VAR) or ROOT / "work").expanduser().resolve()


def working_copy(lab: str, work: Path | None = None) -> Path:
    return (work or work_dir()) / f"{lab}.ipynb"


def _newest_mtime(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.rglob("*.py") if "__pycache__" not in p.parts), default=0.0)


def stale_labs(course: Course, labs: list[str] | None = None) -> list[str]:
    """Labs whose release is missing or older than their file in labs/."""
    sources = lab_sources()
    return [lab for lab in labs or sources
            if not course.release(lab).is_file() or course.release(lab).stat().st_mtime < sources[lab].stat().st_mtime]


def ensure_built(course: Course, labs: list[str] | None = None) -> list[str]:
    """Build the release of every stale lab and refresh a student package older than the package;
    returns the labs rebuilt."""
    stale = stale_labs(course, labs)
    if stale:
        print(f"building the release of {', '.join(stale)} in {course.root}", file=sys.stderr, flush=True)
        course.check_gradebook()
        build(course, stale)
    elif _newest_mtime(ROOT / "fastdl_lab") > _newest_mtime(course.student_package):
        strip_package(ROOT / "fastdl_lab", course.student_package / "fastdl_lab")
    return stale


def make_working_copies(course: Course, work: Path) -> list[Path]:
    """Copy each lab's release into ``work`` where no copy exists yet; returns the new copies."""
    work.mkdir(parents=True, exist_ok=True)
    made = []
    for lab in lab_sources():
        target = working_copy(lab, work)
        if os.path.lexists(target):
            continue  # the learner's own work: never replaced
        nb = nbformat.read(course.release(lab), as_version=4)
        nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": KERNEL_DISPLAY, "language": "python"}
        # Written as JupyterLab writes it (current minor version, cell ids), so opening the copy
        # changes nothing and does not mark it modified.
        nb = nbformat.from_dict(nb)
        nbformat.validator.normalize(nb)
        tmp = target.with_name(f".{target.name}.tmp")
        nbformat.write(nb, tmp)
        os.replace(tmp, target)
        made.append(target)
    return made


def install_kernel(course: Course, data_dir: Path) -> Path:
    """Write the ``fastdl-student`` kernel spec under ``data_dir`` (a Jupyter data folder)."""
    spec_dir = data_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    launcher = spec_dir / "launch.py"
    launcher.write_text(LAUNCHER.format(hidden=os.path.realpath(ROOT)))
    spec = {
        # The venv's python by its own path (not resolved), so its site-packages are used.
        "argv": [sys.executable, str(launcher), "-f", "{connection_file}"],
        "display_name": KERNEL_DISPLAY,
        "language": "python",
        "env": {"PYTHONPATH": str(course.student_package)},
        "metadata": {"debugger": True},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return spec_dir


def jupyter_data_dir() -> Path:
    from jupyter_core.paths import jupyter_data_dir as default

    return Path(default())


def prepare(course: Course, work: Path | None = None, data_dir: Path | None = None) -> list[Path]:
    """Everything ``make lab`` needs: a fresh release, the working copies and the kernel spec."""
    work = work or work_dir()
    ensure_built(course)
    install_kernel(course, data_dir or jupyter_data_dir())
    return make_working_copies(course, work)


def lab_command(work: Path, *args: str, env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``make lab``'s JupyterLab on ``work`` (to be run with
    ``work`` as its working folder), ``args`` added: ``make lab`` and the browser test both start
    it from here, so the test sees what a learner sees."""
    env = dict(os.environ if env is None else env)
    # The kernel then picks matplotlib's inline backend; the Makefile exports Agg for everything else.
    env.pop("MPLBACKEND", None)
    env["JUPYTER_CONFIG_PATH"] = str(SETTINGS)
    # Root is refused by default; a container or a CI machine often runs as root.
    argv = [sys.executable, "-m", "jupyter", "lab", "--allow-root", f"--ServerApp.root_dir={work}", *args]
    return argv, env
