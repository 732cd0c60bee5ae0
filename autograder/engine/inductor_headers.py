"""inductor's precompiled C++ header, made once per machine for the kernels nbgrader starts.

``torch.compile`` on the CPU writes C++ whose first line includes ``cpp_prefix.h``. Before the first
build, inductor precompiles that header (about 6 s and 150 MB on the 2-core machines) into
``<tmp>/torchinductor_<user>/precompiled_headers``. That is always the default cache folder, never
the one TORCHINDUCTOR_CACHE_DIR names. The kernel nbgrader runs a notebook in starts with an empty
private /tmp, so every notebook that compiled anything paid for the header again: in lab 02 it
was half of nbgrader's run.

``ensure`` makes the folder once per machine and torch. A sandboxed process, started as the kernel is
(same view, same environment), compiles a small function and copies out what inductor put there;
the grader keeps its own copy. ``kernel_jail`` gives each kernel an empty folder of its own where
inductor looks, which it may write (inductor keeps its lock files there), with each of the
grader's headers bound into it read-only (``view``). A read-only mount holds whatever the
kernel's uid is outside: a grader that is not root runs kernels as its own uid, which owns the
files. So no kernel can change the header the next one reads. Each header's name is a digest of
the compiler, its command line and the preprocessed header, so a compile that differs in any of
them makes its own header, as before. The header changes how long a compile takes, never what it
compiles.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from autograder.engine import bwrap

# Carried by nbgrader's environment to kernel_jail: the grader's folder of headers.
FOLDER_VAR = "FASTDL_INDUCTOR_HEADERS"
# Written beside the headers: where inductor looks for them inside the sandbox.
WHERE_FILE = "where.json"
HEADER_NAME = re.compile(r"^[a-z0-9]{20,80}\.h(\.gch)?$")
MADE_TIMEOUT_S = 600
_FAILED: set[Path] = set()

# Run in the sandbox: compile one function as a notebook would, then copy inductor's headers out.
_WARM_UP = """
import json, os, shutil, sys
import torch
from torch._inductor import codecache
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

torch.compile(lambda x: (x * 2.0 + 1.0).relu().sum())(torch.randn(4096))
made = getattr(codecache, "_HEADER_DIR", os.path.join(default_cache_dir(), "precompiled_headers"))
out = os.path.join(sys.argv[1], "headers")
os.mkdir(out)
for name in os.listdir(made):
    if os.path.isfile(os.path.join(made, name)):
        shutil.copyfile(os.path.join(made, name), os.path.join(out, name))
print(json.dumps({"inside": made}))
"""


def default_root() -> Path:
    from fastdl_lab.custom import pch

    return pch.default_root().parent / "inductor-headers"


def _key() -> str:
    # A header of another torch or interpreter would only be ignored; keep the folder apart anyway.
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"torch-{version('torch')}-{bwrap.PYTHON}").strip("-")[:120]


def ready(folder: Path) -> dict | None:
    """What ``folder`` holds when made (``inside``: the folder the headers belong in), else None."""
    try:
        where = json.loads((folder / WHERE_FILE).read_text())
    except (OSError, ValueError):
        return None
    inside = where.get("inside") if isinstance(where, dict) else None
    if not isinstance(inside, str) or not inside.startswith("/tmp/") or ".." in inside.split("/"):
        return None
    return where


def _headers(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if HEADER_NAME.match(p.name) and stat.S_ISREG(p.lstat().st_mode)]


def _reported(output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith('{"inside": '):
            return json.loads(line)
    raise RuntimeError(f"inductor's headers could not be made: no folder reported in {output[-300:]!r}")


def _make(folder: Path, env: dict[str, str], gpu: bool) -> None:
    from autograder.engine.sandbox import Limits, run_sandboxed

    work = tempfile.mkdtemp(prefix="fastdl-inductor-")
    making = folder.parent / f".{folder.name}-{os.getpid()}"
    try:
        bwrap.prepare_workdir(work)
        limits = Limits(wall_s=MADE_TIMEOUT_S, cpu_s=2 * MADE_TIMEOUT_S)
        done = run_sandboxed([bwrap.PYTHON, "-c", _WARM_UP, bwrap.JOB], limits=limits, cwd=work, env=env,
                             view=bwrap.View(work, gpu=gpu))
        if not done.ok:
            raise RuntimeError(f"inductor's headers could not be made: {done.reason}: {done.output_tail[-500:]}")
        where = _reported(done.output_tail)
        made = Path(work, "headers")
        shutil.rmtree(making, ignore_errors=True)
        making.mkdir(parents=True)
        for header in _headers(made):  # copied: the grader's own files, not the sandboxed uid's
            shutil.copyfile(header, making / header.name)
            (making / header.name).chmod(0o444)
        (making / WHERE_FILE).write_text(json.dumps({"inside": where["inside"]}))
        if ready(making) is None:
            raise RuntimeError(f"inductor's headers could not be made: it named {where['inside']!r}")
        shutil.rmtree(folder, ignore_errors=True)
        making.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(making, ignore_errors=True)  # only left where it was not finished


def ensure(env: dict[str, str], gpu: bool = False, root: Path | None = None) -> Path | None:
    """The machine's folder of inductor headers, made on first use in a sandbox with ``env`` and
    the devices (``gpu``) of a kernel; None where it cannot be made (each kernel then makes its own).
    Processes that call this at once make it once."""
    root = Path(root or default_root())
    folder = root / _key()
    if ready(folder):
        return folder
    if folder in _FAILED:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not ready(folder):
                _make(folder, env, gpu)
                for other in root.iterdir():  # 150 MB a torch: one is kept
                    if other.is_dir() and other != folder and not other.name.startswith("."):
                        shutil.rmtree(other, ignore_errors=True)
    except Exception as exc:  # noqa: BLE001 - a missing speed-up must never stop a grading
        _FAILED.add(folder)  # tried once per process: each try costs a sandboxed compile
        print(f"note: notebook kernels make inductor's header each time: {exc}", file=sys.stderr)
        return None
    return folder


def view(folder: Path) -> tuple[str, dict[str, str]] | None:
    """How a kernel sees the headers in ``folder``: (the folder it may write, made in its own
    capped /tmp; each header, bound read-only into it), or None if ``folder`` is not ready."""
    where = ready(folder)
    if where is None:
        return None
    inside = where["inside"]
    return inside, {str(header): f"{inside}/{header.name}" for header in _headers(folder)}
