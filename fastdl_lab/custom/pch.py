"""A precompiled ``torch/extension.h``: half of every C++ extension build's time.

``load_inline`` starts every C++ source with ``#include <torch/extension.h>``, and g++ spends
about half of a build (16 of 32 s for the LLTM at -O2 on the 2-core machines) parsing it. GCC
looks for ``NAME.gch`` before ``NAME`` in each folder of the include path. A folder holding
``torch/extension.h.gch``, put first on the path (``extra_include_paths``), hands the parsed
header to every build made with the flags it was made with. GCC checks that itself: where the
compiler, the defines or the options differ, it ignores the .gch (``-Winvalid-pch`` says why)
and reads the folder's ``torch/extension.h``, which includes the real header. A precompiled
header changes how long a build takes, never what it builds.

The folder is made once per compiler, torch and flags (``ensure``: about 45 s and 0.8 GB), under
a root that holds one folder per such key: ``$FASTDL_TORCH_PCH`` (a course image makes one
there), else the build cache. A build never makes it: ``build_cpp`` uses it where it is ready. The
grader makes it in its own process and shows it to the sandboxed build read-only.
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
# Read when the .gch cannot be used: the search goes on past this folder, to torch's own header.
FALLBACK = "#pragma once\n#include_next <torch/extension.h>\n"
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
    """The options ``load_inline`` compiles a CPU source with, less its include folders and the
    extension's name (which torch/extension.h does not read)."""
    return ["-DTORCH_API_INCLUDE_EXTENSION_H", "-fPIC", f"-std={_standard()}", *optimise]


def _include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    folders = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [arg for folder in folders for arg in ("-isystem", folder)]


def key(optimise: list[str]) -> str:
    """What a precompiled header is valid for: the compiler's version, torch's, and the flags."""
    import torch

    compiler = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=60).stdout
    digest = hashlib.sha256("\0".join([compiler.splitlines()[0] if compiler else "", torch.__version__,
                                       *flags(optimise)]).encode())
    return digest.hexdigest()[:16]


def default_root() -> Path:
    from fastdl_lab.custom.sources import REPO

    named = os.environ.get(ENV_VAR)
    return Path(named) if named else REPO / "build" / "cache" / "pch"


def _ready(folder: Path, wanted: str) -> bool:
    made = folder / KEY_FILE
    return (folder / f"{HEADER}.gch").is_file() and made.is_file() and made.read_text().strip() == wanted


def usable(optimise: list[str]) -> Path | None:
    """The folder a build should put first on its include path, or None (none is ready)."""
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
        (making / HEADER).write_text(FALLBACK)
        from torch.utils.cpp_extension import include_paths

        real = next(Path(p) / HEADER for p in include_paths("cpu") if (Path(p) / HEADER).is_file())
        argv = [_compiler(), "-x", "c++-header", str(real), "-o", str(making / f"{HEADER}.gch"),
                *_include_flags(), *flags(optimise)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            shutil.rmtree(making, ignore_errors=True)
            raise RuntimeError(f"cannot precompile {HEADER}: {done.stderr.strip()[-1000:]}")
        (making / KEY_FILE).write_text(wanted + "\n")
        making.rename(folder)
        # Folders of other compilers, torch versions or flags are 0.8 GB each: one is kept.
        for other in root.iterdir():
            if other.is_dir() and other != folder:
                shutil.rmtree(other, ignore_errors=True)
    return folder
