"""The filesystem, user and namespace isolation of every process that runs student code.

A student process is started through bubblewrap: its own mount, pid, ipc, uts and network
namespaces, an unprivileged uid, and a root filesystem built from nothing but

- the Python installation and the virtual environment, read-only (an installed full copy of
  ``fastdl_lab`` in site-packages is hidden under an empty directory);
- the C and C++ compilers, their assembler, linker, headers and libraries, and the CUDA toolkit,
  read-only, wherever they are installed (``toolchain.py``);
- the read-only folders the caller names (the *student* copy of the package, the grader's own
  driver code);
- one private, writable work directory, ``/job``: for student code a capped tmpfs holding the
  grader's files for it read-only in ``/job/in``;
- a private ``/tmp``, a minimal ``/dev`` (plus the NVIDIA devices on GPU hosts) and its own
  ``/proc``, in which the grader's processes do not exist.

Run as root, bubblewrap sets the mounts up and ``setpriv`` then drops to uid/gid 65534 with every
capability gone and ``no_new_privs`` set, so the student is a real unprivileged user outside too
(files it writes are owned by ``nobody``, it cannot leave its cgroup). Run as an ordinary user,
bubblewrap maps the user into a user namespace instead. When bubblewrap dies, the kernel kills
every process of its pid namespace: nothing a submission starts outlives it.
"""

from __future__ import annotations

import functools
import glob
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from autograder.engine import toolchain

NOBODY = 65534


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "nobody"


# The sandbox's uid by name, as its USER and LOGNAME say. A library may settle a path on the user
# name when it is imported (inductor's folder of precompiled headers, /tmp/torchinductor_<user>):
# a fork server imports outside the sandbox, as the grader, and its children must find the same
# path there as a process that imported inside.
NOBODY_NAME = _user_name(NOBODY)
JOB = "/job"
# Where the student copy of the package appears inside the sandbox.
STUDENT_DIR = "/opt/fastdl/student"
SETPRIV = "/usr/bin/setpriv"
# Read-only system paths a Python process and Triton's GPU launcher need (/usr holds the CUDA
# toolkit and driver libraries too); nothing of /etc but the user database (torch asks who it
# is), the linker's cache, Debian's alternatives (cc -> gcc) and fontconfig's configuration
# (without it every notebook that imports matplotlib prints an error).
SYSTEM_RO = ("/usr", "/etc/alternatives", "/etc/passwd", "/etc/group", "/etc/ld.so.cache", "/etc/fonts")
# The sandbox's name and its /etc/hosts, not the host's: gloo and torch's TCP store resolve the
# host name and their peers' addresses, and without an answer warn in every rank (in the
# student's notebook record too). The grading host's own names stay out of the sandbox.
HOSTNAME = "localhost"
HOSTS_FILE = str(Path(__file__).with_name("sandbox_hosts"))
MERGED_USR = ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
# The sandbox's own /dev/shm (shared-memory tensors of DataLoader workers, semaphores).
SHM_BYTES = 1 << 30
# The sandbox's /tmp (compiler scratch files, Triton's build folder).
TMP_BYTES = 1 << 30
# The /job of a sandbox that runs student code (``View.job_bytes``): its home and caches.
JOB_BYTES = 1 << 30
# The interpreter as the sandbox sees it: a path with ".." through folders it lacks would not resolve.
PYTHON = os.path.normpath(os.path.abspath(sys.executable))


class IsolationUnavailable(RuntimeError):
    """This machine cannot isolate student code; the message says why and what to do."""


@dataclass
class View:
    """What one sandboxed process sees besides the system: read-only folders and its work dir."""

    workdir: str
    read_only: dict[str, str] = field(default_factory=dict)  # host path -> path inside
    # host folder -> path inside its private /tmp, writable; the folders on the way there are
    # made world-writable and sticky, as /tmp is. A read-only file may be bound inside one.
    scratch: dict[str, str] = field(default_factory=dict)
    # Folders made writable (world-writable and sticky, as /tmp is) inside the private /tmp, in its
    # capped tmpfs; a read-only file may be bound inside one.
    tmp_dirs: tuple[str, ...] = ()
    network: bool = False  # share the caller's network namespace (a kernel nbgrader talks to)
    gpu: bool = False
    # With a size, ``/job`` is a tmpfs of that many bytes, and ``workdir`` is shown read-only inside
    # it as ``/job/<job_in>``: what the sandbox writes is capped, stays in memory its cgroup counts,
    # and never reaches the host's disk. Without one, ``workdir`` itself is ``/job``, writable (for
    # the grader's own trusted builds, which keep what they make).
    job_bytes: int | None = None
    job_in: str = "in"


def _python_paths() -> list[str]:
    """The interpreter's installation and the virtual environment, whatever their location."""
    paths = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}
    return sorted(p for p in paths if p != "/usr" and not p.startswith("/usr/"))


def shown() -> tuple[str, ...]:
    """The host folders every sandbox shows: what is found below them needs no bind of its own."""
    return (*SYSTEM_RO, *MERGED_USR, *_python_paths())


def _hidden_full_package() -> list[str]:
    """A non-editable install of the full package would put the solutions in site-packages."""
    site = sysconfig.get_paths()["purelib"]
    return [str(p) for p in Path(site).glob("fastdl_lab") if p.is_dir()]


def _parents(path: str) -> list[str]:
    parts = Path(path).parts[1:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _dir_ops(path: str, made: set[str], perms: str = "0755") -> list[list]:
    # Mount points the sandbox creates would be root-only; the dropped uid must traverse them.
    ops = []
    for parent in _parents(path):
        if parent not in made:
            made.add(parent)
            ops.append(["dir", parent, perms])
    return ops


def plan(view: View) -> list[list]:
    """The sandbox's filesystem, step by step, as JSON-ready lists; :func:`command` hands it to
    bubblewrap, and the fork server (``forkserver.py``) builds the same tree itself. Each step is
    one of ``["symlink", target, path]``, ``["dir", path, perms]``, ``["ro-bind", host, path]``,
    ``["ro-bind-try", host, path]`` (skipped when the host path is missing), ``["bind", host, path]``,
    ``["dev-bind", host, path]``, ``["tmpfs", path, perms or None, bytes or None]``,
    ``["proc", path]`` and ``["dev", path]``."""
    ops: list[list] = []
    for path in MERGED_USR:
        if os.path.islink(path):
            ops.append(["symlink", os.readlink(path), path])
        elif os.path.isdir(path):
            ops.append(["ro-bind", path, path])
    made: set[str] = set()
    for path in SYSTEM_RO:
        ops += _dir_ops(path, made) + [["ro-bind-try", path, path]]
    ops.append(["ro-bind", HOSTS_FILE, "/etc/hosts"])
    # /tmp first: the Python installation or the course may live below /tmp (a CI clone does).
    # Capped like /dev/shm below: a file parked in a tmpfs is memory no resident-set limit sees.
    # Sticky and world-writable as a /tmp is: a /tmp the dropped uid cannot write sends every
    # temporary file (Python's tempfile falls back to the working directory) to the uncapped
    # work directory on the host's disk instead.
    ops += [["proc", "/proc"], ["dev", "/dev"], ["tmpfs", "/tmp", "01777", TMP_BYTES]]
    # A plain /dev/shm would be root's, which the dropped uid cannot write: POSIX semaphores
    # (every multiprocessing Lock and Queue, so every DataLoader with workers) and torch's
    # shared-memory tensors live there. A sticky, world-writable tmpfs of its own fixes that; its
    # size is capped because pages parked there and unmapped are memory the resident-set
    # watchdog does not see.
    ops.append(["tmpfs", "/dev/shm", "01777", SHM_BYTES])
    # Before the read-only binds, which may put files inside a scratch folder.
    made.add("/tmp")
    for host, inside in view.scratch.items():
        if not inside.startswith("/tmp/"):
            raise ValueError(f"{inside}: a scratch folder lives in the sandbox's /tmp")
        ops += _dir_ops(inside, made, "01777") + [["bind", host, inside]]
        made.add(inside)
    for inside in view.tmp_dirs:
        if not inside.startswith("/tmp/"):
            raise ValueError(f"{inside}: a scratch folder lives in the sandbox's /tmp")
        ops += _dir_ops(inside, made, "01777") + [["dir", inside, "01777"]]
        made.add(inside)
    for path in _python_paths():
        ops += _dir_ops(path, made) + [["ro-bind", path, path]]
    # The compilers Triton's launcher, lab 09's extensions and torch.compile build with, wherever
    # this machine installed them (/opt/gcc on the lent GPU image): see toolchain.py.
    for path in toolchain.find(shown=shown()).binds:
        ops += _dir_ops(path, made) + [["ro-bind", path, path]]
    for host, inside in view.read_only.items():
        ops += _dir_ops(inside, made) + [["ro-bind", host, inside]]
    for path in _hidden_full_package():
        ops.append(["tmpfs", path, None, None])
    if view.job_bytes:
        ops.append(["tmpfs", JOB, "01777", view.job_bytes])
        ops.append(["ro-bind", view.workdir, f"{JOB}/{view.job_in}"])
    else:
        ops.append(["bind", view.workdir, JOB])
    if view.gpu:
        ops += [["dev-bind", dev, dev] for dev in sorted(glob.glob("/dev/nvidia*"))]
    return ops


def _bwrap_args(op: list) -> list[str]:
    kind, *rest = op
    if kind == "dir":
        return ["--perms", rest[1], "--dir", rest[0]]
    if kind == "tmpfs":
        path, perms, size = rest
        return ((["--perms", perms] if perms else []) + (["--size", str(size)] if size else [])
                + ["--tmpfs", path])
    if kind in ("proc", "dev"):
        return [f"--{kind}", rest[0]]
    return [f"--{kind}", *rest]


def command(argv: list[str], view: View) -> list[str]:
    """The full command line that runs ``argv`` inside the sandbox described by ``view``."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable("bubblewrap (bwrap) is not installed")
    root = os.geteuid() == 0
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--hostname", HOSTNAME, "--unshare-cgroup-try"]
    if not view.network:
        args.append("--unshare-net")  # bubblewrap brings loopback up in the new namespace
    if not root:
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    for op in plan(view):
        args += _bwrap_args(op)
    # The root bubblewrap builds is a tmpfs; in a user namespace the sandbox's uid owns it and,
    # writable, it would hold files in memory no limit sees.
    args += ["--remount-ro", "/", "--chdir", JOB, "--"]
    if root:
        args += [SETPRIV, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return args + argv


# The host's variables a process running course code gets, by name, and why. Everything else of
# the grader's environment stays behind: an inherited TRITON_INTERPRET=1 would make every launcher
# refuse CUDA tensors on a GPU host, and TRITON_DEBUG, TRITON_ALWAYS_COMPILE, PYTORCH_* and the like
# would change what is measured.
HOST_VARS = {
    "CUDA_VISIBLE_DEVICES": "which GPUs the grader was given",
    "LD_LIBRARY_PATH": "where libcuda.so is when the loader's cache does not list it",
    "CUDA_HOME": "the CUDA toolkit torch.utils.cpp_extension builds lab 09's CUDA C++ with",
    "CC": "the C compiler Triton builds its launcher with on first use (else gcc, else clang on PATH)",
    "CXX": "the C++ compiler of lab 09's extensions (torch.utils.cpp_extension)",
    "TRITON_LIBCUDA_PATH": "Triton's own pointer to libcuda.so's folder, for hosts where it cannot find it",
    "TRITON_PTXAS_PATH": "a ptxas newer than the one Triton bundles, for a GPU newer than that ptxas",
    "TRITON_CUDART_PATH": "the CUDA headers the launcher is built against, where a Triton build (conda-forge's) "
                          "bundles none",
    "TRITON_CUDACRT_PATH": "the same, for the CUDA C runtime headers",
}


def device_environment(gpu: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """How course code finds (or is kept from) the GPU: the :data:`HOST_VARS` that are set, and on
    a profile without a GPU the interpreter on and no device visible. TRITON_INTERPRET never comes
    from the host."""
    environ = os.environ if environ is None else environ
    env = {var: environ[var] for var in HOST_VARS if var in environ}
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def environment(*, gpu: bool, home: str = JOB, tmp: str = "/tmp", **extra: str) -> dict[str, str]:
    """What every process that runs student code starts from: nothing of the grader's own
    environment but the search path and :func:`device_environment`. Without a GPU, Triton runs
    its interpreter and torch sees no device."""
    # Compiler caches live in the private work directory: a build one submission left behind can
    # never be loaded by another's (Triton kernels, C++ extensions built with load_inline).
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home, "TMPDIR": tmp,
           "USER": NOBODY_NAME, "LOGNAME": NOBODY_NAME,
           "PYTHONDONTWRITEBYTECODE": "1", "TRITON_CACHE_DIR": os.path.join(home, ".triton"),
           "TORCH_EXTENSIONS_DIR": os.path.join(home, ".torch_extensions"), **extra}
    return {**device_environment(gpu), **env}


def prepare_workdir(path: str) -> None:
    """The sandboxed uid owns its work directory, and nothing else."""
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o700)


@functools.cache
def check() -> None:
    """Raise ``IsolationUnavailable`` unless a sandboxed process really starts here."""
    import tempfile

    if os.geteuid() == 0 and not os.path.exists(SETPRIV):
        raise IsolationUnavailable(f"{SETPRIV} (util-linux) is missing: cannot drop to an unprivileged uid")
    with tempfile.TemporaryDirectory(prefix="fastdl-probe-") as tmp:
        prepare_workdir(tmp)
        probe = "import os; open('/job/ok', 'w').write(str(os.getuid()))"
        try:
            done = subprocess.run(command([PYTHON, "-c", probe], View(tmp)),
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise IsolationUnavailable(f"bubblewrap could not start: {exc}") from exc
        ok = Path(tmp, "ok")
        if done.returncode != 0 or not ok.exists() or ok.read_text() != str(NOBODY):
            detail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
            raise IsolationUnavailable(
                f"bubblewrap could not run a sandboxed process ({detail[0][:200]}); where that names "
                "namespaces or permissions, unprivileged user namespaces may be disabled "
                "(sysctl kernel.unprivileged_userns_clone=1) or the grader lacks the rights to create them")
