"""What every build of the course's C++ extension reuses, made once per machine: a precompiled
tensor header and the extension's Python bindings, compiled.

A C++ source of the course computes with ATen and nothing else (lab 09 refuses the rest), yet
``load_inline`` compiles it after ``#include <torch/extension.h>``, all of torch's C++ front end
and pybind11. g++ spent about 17 of a build's 18 s (LLTM, -O2, the 2-core machines) on that
header even precompiled, an empty source included: pybind11's templates are instantiated and
generated anew in every translation unit. ``build_cpp`` therefore compiles two units:

- the source, in which ``torch/extension.h`` is this folder's ``torch/extension.h``: the tensor
  API only (``<torch/types.h>``: ATen and the ``torch::`` names), precompiled. A build reads it the
  same with or without the .gch, so what compiles never depends on whether one is ready;
- the bindings (``sources.BINDINGS_SOURCE``), which never change, compiled here once into
  ``BINDINGS``.

GCC looks for ``NAME.gch`` before ``NAME`` in each folder of the include path, and checks the
.gch itself: where the compiler, the defines or the options differ, it ignores it
(``-Winvalid-pch`` says why) and reads the header. A precompiled header changes how long a build
takes, never what it builds.

The folder is made once per compiler, torch and flags (``ensure``: about 30 s on 2 cores and
0.45 GB), under a root that holds one folder per such key: ``$FASTDL_TORCH_PCH`` (a course image
makes one there), else the build cache. A build never makes it: ``build_cpp`` uses it where it
is ready. The grader makes it in its own process and shows it to the sandboxed build read-only.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

# The root of the folders (one per key); unset: the build cache's.
ENV_VAR = "FASTDL_TORCH_PCH"
HEADER = "torch/extension.h"
# What a source's #include <torch/extension.h> reads: the tensor API, without the Python side.
TENSOR_HEADER = "#pragma once\n#include <torch/types.h>\n"
BINDINGS = "bindings.o"
KEY_FILE = "key"


def _compiler() -> str:
    from torch.utils.cpp_extension import get_cxx_compiler

    return get_cxx_compiler()


@functools.cache
def _standard() -> str:
    """The C++ standard torch's build of an extension asks for: c++20 from torch 2.13's
    ``cpp_extension``, c++17 from 2.11's. Read from the function that writes the build's ninja
    file, since torch exposes it nowhere else; where it cannot be read, c++17, and a build that
    asks for another standard only ignores the .gch."""
    import inspect

    from torch.utils import cpp_extension

    try:
        source = inspect.getsource(cpp_extension._write_ninja_file_to_build_library)
    except (AttributeError, OSError, TypeError):
        return "c++17"
    found = re.search(r"cflags = common_cflags \+ \[[^]]*'-std=(c\+\+\d+)'", source)
    return found.group(1) if found else "c++17"


def flags(optimise: list[str]) -> list[str]:
    """The options torch's ``load`` compiles a CPU source with, less its include folders and the
    extension's name (which neither the header nor the bindings read)."""
    return ["-DTORCH_API_INCLUDE_EXTENSION_H", "-fPIC", f"-std={_standard()}", *optimise]


def _include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    folders = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [arg for folder in folders for arg in ("-isystem", folder)]


def key(optimise: list[str]) -> str:
    """What a folder is valid for: the compiler's version, torch's, the flags, and what it holds."""
    import torch

    from fastdl_lab.custom.sources import BINDINGS_SOURCE

    compiler = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([compiler.splitlines()[0] if compiler else "", torch.__version__,
                                       *flags(optimise), TENSOR_HEADER, BINDINGS_SOURCE]).encode())
    return digest.hexdigest()[:16]


def default_root() -> Path:
    from fastdl_lab.custom.sources import REPO

    named = os.environ.get(ENV_VAR)
    return Path(named) if named else REPO / "build" / "cache" / "pch"


def _ready(folder: Path, wanted: str) -> bool:
    made = folder / KEY_FILE
    return ((folder / f"{HEADER}.gch").is_file() and (folder / BINDINGS).is_file() and made.is_file()
            and made.read_text().strip() == wanted)


def usable(optimise: list[str]) -> Path | None:
    """The ready folder a build puts first on its include path and links ``BINDINGS`` from, or
    None (none is ready)."""
    wanted = key(optimise)
    folder = default_root() / wanted
    try:
        return folder if _ready(folder, wanted) else None
    except OSError:
        return None


def ensure(optimise: list[str], root: Path | None = None) -> Path:
    """The ready folder under ``root`` (default: ``default_root()``), made if missing. Processes
    that call this at once make it once: the others wait on a lock, then find it ready."""
    root = Path(root or default_root())
    wanted = key(optimise)
    folder = root / wanted
    if _ready(folder, wanted):  # a root made read-only (a course image's) is only read
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(folder, wanted):
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        making = root / f".{folder.name}-{os.getpid()}"
        shutil.rmtree(making, ignore_errors=True)
        (making / "torch").mkdir(parents=True)
        (making / HEADER).write_text(TENSOR_HEADER)
        _compile_both(making, optimise)
        (making / KEY_FILE).write_text(wanted + "\n")
        making.rename(folder)
        # Folders of other compilers, torch versions or flags are 0.45 GB each: one is kept.
        for other in root.iterdir():
            if other.is_dir() and other != folder:
                shutil.rmtree(other, ignore_errors=True)
    return folder


def _compile_both(making: Path, optimise: list[str]) -> None:
    """The header's .gch and the bindings' object, side by side (one core each)."""
    from fastdl_lab.custom.sources import BINDINGS_SOURCE

    (making / "bindings.cpp").write_text(BINDINGS_SOURCE)
    common = [*_include_flags(), *flags(optimise)]
    # The bindings include torch's own headers: this folder is not on their include path.
    jobs = {HEADER: [_compiler(), "-x", "c++-header", str(making / HEADER), "-o", str(making / f"{HEADER}.gch"), *common],
            BINDINGS: [_compiler(), "-c", str(making / "bindings.cpp"), "-o", str(making / BINDINGS), *common]}
    running = {what: subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for what, argv in jobs.items()}
    failed = []
    for what, proc in running.items():
        try:
            _, err = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{what}: {err.strip()[-1000:]}")
    if failed:
        shutil.rmtree(making, ignore_errors=True)
        raise RuntimeError("cannot precompile " + "; ".join(failed))
    (making / "bindings.cpp").unlink()
