"""``make hub``: the course's JupyterHub on this machine, on loopback only, to try a term with it.

It builds the course once (``build/hub/course``), makes nbgrader's exchange, picks a password,
prints the address and the names to log in with, and runs JupyterHub with
``deploy/jupyterhub_config.py`` in trial mode: every server runs as the user who started it,
each in its own home folder under ``build/hub/home`` (the config says what that does not protect).
The end-to-end test starts its hub through the same functions, on free ports.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import secrets
import shutil
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "jupyterhub_config.py"
PROXY = ROOT / "build" / "cache" / "npm" / "node_modules" / ".bin" / "configurable-http-proxy"
# nbgrader asks for an exchange everyone can write to; sticky, like /tmp, so that no user can
# rename or remove a folder another user made there (a course's outbound, a submission).
EXCHANGE_MODE = 0o1777


@dataclasses.dataclass(frozen=True)
class Trial:
    state: Path
    port: int = 8000
    api_port: int = 8081
    proxy_api_port: int = 8001
    formgrader_port: int = 9999
    instructors: tuple[str, ...] = ("instructor",)
    students: tuple[str, ...] = ("student1", "student2")

    @property
    def course(self) -> Path:
        return self.state / "course"

    @property
    def exchange(self) -> Path:
        return self.state / "exchange"

    def home(self, user: str) -> Path:
        return self.state / "home" / user

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports nothing listens on now (the OS picks them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def missing_prerequisites() -> list[str]:
    """What stops a hub from starting here, each with the way to get it."""
    missing = []
    if importlib.util.find_spec("jupyterhub") is None:
        missing.append("JupyterHub is not installed in this environment: pip install -e '.[hub]' (make hub does it)")
    if shutil.which("node") is None:
        missing.append("Node.js is missing (the hub's proxy runs on it): apt-get install nodejs npm")
    if not os.access(PROXY, os.X_OK):
        missing.append(f"configurable-http-proxy is not at {PROXY}: make hub-proxy installs it from the npm registry")
    return missing


def prepare(trial: Trial, labs: list[str] | None = None, rebuild: bool = False) -> None:
    """The hub's folders, the exchange and, when it has not been built (or ``rebuild``), the course
    (``labs`` only, or every lab)."""
    for folder in (trial.state, trial.home("grader-fastdl-lab")):
        folder.mkdir(parents=True, exist_ok=True)
    trial.exchange.mkdir(exist_ok=True)
    trial.exchange.chmod(EXCHANGE_MODE)
    if rebuild or not (trial.course / "student_package").is_dir():
        from autograder.course import Course, build

        print(f"building the course in {trial.course} (once; nbgrader needs a few seconds per lab)", flush=True)
        build(Course(trial.course), labs)


def environment(trial: Trial, password: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTDL_HUB", "JUPYTERHUB"))}
    env.update({
        "FASTDL_HUB_MODE": "trial",
        "FASTDL_HUB_PASSWORD": password,
        "FASTDL_HUB_STATE": str(trial.state),
        "FASTDL_HUB_IP": "127.0.0.1",
        "FASTDL_HUB_PORT": str(trial.port),
        "FASTDL_HUB_API_PORT": str(trial.api_port),
        "FASTDL_PROXY_API_PORT": str(trial.proxy_api_port),
        "FASTDL_FORMGRADER_PORT": str(trial.formgrader_port),
        "FASTDL_PROXY": str(PROXY),
        "FASTDL_PYTHON_BIN": str(Path(sys.executable).parent),
        "FASTDL_EXCHANGE": str(trial.exchange),
        "FASTDL_COURSE_DIR": str(trial.course),
        "FASTDL_STUDENT_PACKAGE": str(trial.course / "student_package"),
        "FASTDL_INSTRUCTOR_PACKAGE": str(ROOT),
        "FASTDL_INSTRUCTORS": ",".join(trial.instructors),
        "FASTDL_STUDENTS": ",".join(trial.students),
        # The proxy is a Node program: it finds node on PATH.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    })
    return env


def command() -> list[str]:
    return [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG)]


def banner(trial: Trial, password: str) -> str:
    return "\n".join([
        f"fastdl-lab JupyterHub (trial mode) at {trial.url}/",
        f"  instructors: {', '.join(trial.instructors)} (formgrader at {trial.url}/services/fastdl-lab/)",
        f"  students:    {', '.join(trial.students)}",
        f"  password:    {password}   (the same for every name; it changes at every start)",
        f"  course folder {trial.course}, exchange {trial.exchange}",
        "Trial mode runs every server as this machine's user: try the course with it, never teach with it",
        "(deploy/production/ is the hub for a class). Ctrl-C stops the hub and every server it started.",
    ])


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8000, help="the hub's address on 127.0.0.1 (default 8000)")
    p.add_argument("--students", default="student1,student2", help="comma-separated student names")
    p.add_argument("--instructors", default="instructor", help="comma-separated instructor names")
    p.add_argument("--rebuild", action="store_true", help="build the course again (after editing labs/)")
    args = p.parse_args(argv)
    missing = missing_prerequisites()
    if missing:
        print("cannot start the hub:\n  - " + "\n  - ".join(missing), file=sys.stderr)
        return 2
    # Only the public port is chosen; the hub's internal ones must merely be free.
    api_port, proxy_api_port, formgrader_port = free_ports(3)
    trial = Trial(ROOT / "build" / "hub", port=args.port, api_port=api_port, proxy_api_port=proxy_api_port,
                  formgrader_port=formgrader_port, instructors=_names(args.instructors), students=_names(args.students))
    prepare(trial, rebuild=args.rebuild)
    password = secrets.token_urlsafe(9)
    print(banner(trial, password), flush=True)
    os.chdir(trial.state)
    os.execvpe(command()[0], command(), environment(trial, password))


if __name__ == "__main__":
    sys.exit(main())
