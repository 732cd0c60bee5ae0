"""A process that has imported torch once and forks one sandboxed child per request.

Every sandboxed child used to be a fresh interpreter started by bubblewrap, and ``import torch``
is most of a small item's time (about 2 s of a 2.4 s item on a 2-core machine). This server is
started by the grader (``prefork.py``) with the children's exact environment, imports the
third-party libraries named on its command line and nothing of the course, then waits. For each
request it forks, and the fork isolates itself the way ``bwrap.py`` isolates a fresh process:

- the *monitor* (outside, in the grader's pid namespace) starts a session, enters the item's
  cgroup, sets the rlimits, unshares the mount, pid, ipc, uts, cgroup and (unless shared) network
  namespaces, forks the init and reports how it ended, as bubblewrap's own process does;
- the *init* (pid 1 of the new namespace) builds the root filesystem from ``bwrap.plan`` on a
  fresh tmpfs, pivots into it, detaches the host's tree, brings loopback up and forks the child;
- the *child* starts its own session, drops to uid/gid 65534 with no capabilities in any set and
  ``no_new_privs``, keeps only its output pipe and ``/dev/null`` as file descriptors, takes the
  environment it was given, and runs the code (``-c`` source or ``-m`` module) as ``python`` would.

A request without a plan is a *trusted run* (nbgrader's run of a notebook, whose process runs no
student code: the kernel it talks to is a sandbox of its own). Its monitor enters the jail and sets
the rlimits as above, makes only a network namespace (loopback up where asked), and forks one
process that runs the code as the grader's user on the grader's filesystem: what
``sandbox.run_sandboxed`` gives a process it starts without a view, less the imports. A server is
started for one kind (``sandboxes`` or ``trusted``) and drops every request of the other, whoever
hands it one: a launcher's request relayed to the kernels' server never runs as the grader.

The server never runs student code; only the child does, after every step above. It is run as a
script (``python -P forkserver.py FD KIND PRELOAD...``) so that nothing of the grader's package is
imported in it: what the child finds on ``sys.path`` is what its sandbox shows. Run as root it
mounts in the namespaces it makes and the child drops to a real uid 65534; run as any other user
the monitor also makes a user namespace that maps that user to uid 65534 inside, as bubblewrap's
``--unshare-user --uid`` does. A server that cannot make the namespaces says so instead of
``ready`` (``prefork.py`` then uses bubblewrap). It exits when the grader's end of its socket
closes; every monitor dies with it, and every sandbox with its monitor.

Protocol, over a ``SOCK_SEQPACKET`` socket: the server sends ``ready`` once its imports are done;
each request is one JSON message carrying two descriptors (the reply socket and where the child's
output goes), or three: the last one a network namespace to join instead of making one. On the
reply socket the monitor sends ``{"pid": N}`` once it runs and ``{"exit": CODE}`` when the sandbox
has ended (128 + N for a child killed by signal N); the sandbox ends when the requester closes
its end of that socket.
"""

from __future__ import annotations

# Everything the server, the monitor and the init use is imported here: once the init has pivoted
# into the new root, modules load only from the folders the plan has bound so far.
import atexit
import ctypes
import fcntl
import gc
import importlib
import io
import json
import os
import platform
import random
import re
import resource
import runpy
import select
import signal
import socket
import struct
import sys
import traceback
import types
from typing import NoReturn

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 0x20, 0x400, 0x800, 0x1000, 0x4000
MS_PRIVATE, MS_RELATIME = 0x40000, 0x200000
# A bind's flags that a remount keeps: in a user namespace the kernel refuses to drop any of them.
ST_FLAGS = {os.ST_RDONLY: MS_RDONLY, os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
            os.ST_NOATIME: MS_NOATIME, os.ST_NODIRATIME: MS_NODIRATIME, os.ST_RELATIME: MS_RELATIME}
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NAME, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 15, 24, 38
# Process names (``ps``, /proc/PID/comm) of the server and of each sandbox's processes: all of
# them run the same command line. A monitor is named after what its sandbox runs (the request's
# "label": an item, a kernel).
NAMES = {"server": "fastdl-forksrv", "init": "fastdl-init", "child": "fastdl-child"}
MONITOR_NAME = "fastdl-{label}"
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
CAP_VERSION_3 = 0x20080522
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
# The new root is built on a tmpfs mounted here; the host's tree stays reachable below OLD until
# the plan is done.
BASE, OLD = "/tmp", "/oldroot"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}
EXIT_SETUP = 71  # EX_OSERR: the sandbox could not be made; the output says which step failed
MESSAGE_BYTES = 1 << 20

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """One step of building the sandbox failed."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or ''} on {target}")


def _unshare(flags: int) -> None:
    _check(libc.unshare(flags), "unshare")


def _prctl(option: int, arg: int) -> None:
    _check(libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def _name(name: str) -> None:
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


# ---- the filesystem -------------------------------------------------------------------------

def _mount_point(host: str, path: str) -> None:
    os.makedirs(os.path.dirname(path) or "/", mode=0o755, exist_ok=True)
    if os.path.isdir(host):
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.exists(path):
        open(path, "w").close()


def _mounts_below(path: str) -> list[str]:
    """Mount points at or under ``path`` (after a recursive bind, its submounts are there too)."""
    found = []
    with open(OLD + "/proc/self/mountinfo") as f:  # the sandbox's own /proc may not be there yet
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == path or point.startswith(path.rstrip("/") + "/"):
                found.append(point)
    return found


def _bind(host: str, path: str, *, read_only: bool, devices: bool = False) -> None:
    _mount_point(OLD + host, path)
    _mount(OLD + host, path, None, MS_BIND | MS_REC)
    # Like bubblewrap: binds are nosuid, device nodes work only where asked for, and read-only
    # binds are read-only all the way down, submounts included.
    for point in _mounts_below(path) if read_only else [path]:
        kept = os.statvfs(point).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (MS_RDONLY if read_only else 0)
        flags |= sum(ms for st, ms in ST_FLAGS.items() if kept & st)
        if not devices:
            flags |= MS_NODEV
        _mount(None, point, None, flags)


def _dev(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    _mount("tmpfs", path, "tmpfs", MS_NOSUID, "mode=0755")
    for node in DEV_NODES:
        if os.path.exists(f"{OLD}/dev/{node}"):
            _bind(f"/dev/{node}", f"{path}/{node}", read_only=False, devices=True)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{path}/{name}")
    os.mkdir(f"{path}/shm")
    os.mkdir(f"{path}/pts")
    _mount("devpts", f"{path}/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")


def _apply(op: list) -> None:
    kind, *args = op
    if kind == "symlink":
        os.symlink(args[0], args[1])
    elif kind == "dir":
        os.makedirs(args[0], exist_ok=True)
        os.chmod(args[0], int(args[1], 8))
    elif kind in ("ro-bind", "ro-bind-try"):
        if kind == "ro-bind" or os.path.lexists(OLD + args[0]):
            _bind(args[0], args[1], read_only=True)
    elif kind in ("bind", "dev-bind"):
        _bind(args[0], args[1], read_only=False, devices=kind == "dev-bind")
    elif kind == "tmpfs":
        path, perms, size = args
        os.makedirs(path, mode=0o755, exist_ok=True)
        options = f"mode={perms or '0755'}" + (f",size={size}" if size else "")
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
    elif kind == "proc":
        os.makedirs(args[0], exist_ok=True)
        _mount("proc", args[0], "proc", MS_NOSUID | MS_NOEXEC | MS_NODEV)
    elif kind == "dev":
        _dev(args[0])
    else:
        raise SetupError(f"unknown step {kind!r}")


def _build_root(plan: list[list], chdir: str) -> None:
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", BASE, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
    os.mkdir(BASE + OLD)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise SetupError(f"pivot_root: no system call number known for {platform.machine()}")
    _check(libc.syscall(number, BASE.encode(), (BASE + OLD).encode()), "pivot_root")
    os.chdir("/")
    for op in plan:
        try:
            _apply(op)
        except OSError as exc:
            raise SetupError(f"{op[0]} {' '.join(map(str, op[1:]))}: {exc.strerror}") from None
    _check(libc.umount2(OLD.encode(), MNT_DETACH), "detach the host's tree")
    os.rmdir(OLD)
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(chdir)


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


# ---- the user -------------------------------------------------------------------------------

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_privileges(uid: int) -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    if os.geteuid() == 0:
        os.setgroups([])  # in an unprivileged grader's user namespace setgroups is denied, no group mapped
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    # Leaving uid 0 empties the permitted and effective sets, not the inheritable one; in a user
    # namespace the uid was never 0 and only this empties them.
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(_CapHeader(CAP_VERSION_3, 0)), data), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


# ---- the three processes --------------------------------------------------------------------

def _fail(out: int, step: str, exc: BaseException) -> NoReturn:
    os.write(out, f"sandbox setup failed ({step}): {exc}\n".encode(errors="replace"))
    os._exit(EXIT_SETUP)


def _status_code(status: int) -> int:
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _namespace_flags(network: bool) -> int:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if not network:
        flags |= CLONE_NEWNET
    if os.geteuid() != 0:
        flags |= CLONE_NEWUSER  # the rights to mount come from a user namespace of its own
    return flags


def _enter_namespaces(spec: dict) -> None:
    """Run as root, the sandbox's uid is a real one; otherwise the user namespace maps the grader's
    own uid and gid to it, as bubblewrap's --unshare-user --uid does."""
    uid, gid = os.geteuid(), os.getegid()
    _unshare(_namespace_flags(spec["network"]))
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{spec['uid']} {uid} 1"),
                           ("gid_map", f"{spec['uid']} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _join_network(netns: int | None) -> None:
    """Into the network namespace of the requester (nbgrader's, for a kernel it talks to over
    loopback), when that is not already this one."""
    if netns is not None and os.fstat(netns).st_ino != os.stat("/proc/self/ns/net").st_ino:
        _check(libc.setns(netns, CLONE_NEWNET), "setns into the requester's network")


def _wait_or_end(init: int, reply: socket.socket) -> int:
    """The init's exit status; if the requester's end of ``reply`` closes first (the grader, or a
    kernel's launcher, is gone), the sandbox goes with it, as bubblewrap's --die-with-parent."""
    watch = os.pidfd_open(init)
    while True:
        ready, _, _ = select.select([watch, reply], [], [])
        if watch in ready:
            return os.waitpid(init, 0)[1]
        try:
            gone = reply.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            gone = True
        if gone:
            os.kill(init, signal.SIGKILL)  # pid 1 of the sandbox: every process in it ends
            return os.waitpid(init, 0)[1]


def _monitor(spec: dict, reply: socket.socket, out: int, netns: int | None) -> None:
    """Outside the sandbox: bubblewrap's own process. Reports the pid, then the end."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's auto-reaping must not take the init
    _name(MONITOR_NAME.format(label=spec.get("label", "sandbox")))
    reply.send(json.dumps({"pid": os.getpid()}).encode())
    trusted = spec["plan"] is None
    try:
        os.setsid()
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        for procs in spec.get("jail") or ():  # the cgroup.procs file of each of the jail's controllers
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        for name, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), tuple(value))
        if trusted:
            if not spec["network"]:
                private_network(spec["loopback"], spec["marker"])
        else:
            _join_network(netns)
            _enter_namespaces(spec)
        first = os.fork()
    except (OSError, SetupError) as exc:
        reply.send(json.dumps({"exit": EXIT_SETUP}).encode())
        _fail(out, "namespaces", exc)
    if first == 0:
        reply.close()
        _trusted(spec, out) if trusted else _init(spec, out)
    os.close(out)
    status = _wait_or_end(first, reply)
    try:
        reply.send(json.dumps({"exit": _status_code(status)}).encode())
    except OSError:
        pass  # nobody is left to tell
    os._exit(0)


def private_network(loopback: bool, marker: str) -> None:
    """The network of a process run without a view (a cold one by ``sandbox.run_sandboxed``, or a
    trusted run here): a namespace of its own where one can be made (``marker`` then says so),
    loopback up in it when asked for; the host's network where none can."""
    if libc.unshare(CLONE_NEWNET) != 0:
        return
    if loopback:
        loopback_up()
    with open(marker, "w") as f:
        f.write("isolated")


def _trusted(spec: dict, out: int) -> None:
    """A trusted program (nbgrader's run of a notebook) in the monitor's session, jail and network:
    no filesystem of its own and the grader's uid, as a process started without a view has."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.chdir(spec["chdir"])
    except (OSError, SetupError) as exc:
        _fail(out, "trusted run", exc)
    _run_as_python(spec, out)


def _init(spec: dict, out: int) -> None:
    """Pid 1 of the sandbox: builds its filesystem, starts the child, reaps orphans."""
    _name(NAMES["init"])
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        _build_root(spec["plan"], spec["chdir"])
        socket.sethostname(spec["hostname"])
        if not spec["network"]:
            loopback_up()
        child = os.fork()
    except (OSError, SetupError) as exc:
        _fail(out, "filesystem", exc)
    if child == 0:
        _child(spec, out)
    os.close(out)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(EXIT_SETUP)
        if pid == child:
            os._exit(_status_code(status))


def _standard_streams() -> None:
    def stream(fd: int, mode: str, **kw):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding="utf-8", **kw)

    # As a fresh interpreter would make them in a UTF-8 locale, on a pipe.
    sys.stdin = sys.__stdin__ = stream(0, "r", errors="surrogateescape")
    sys.stdout = sys.__stdout__ = stream(1, "w", errors="surrogateescape")
    sys.stderr = sys.__stderr__ = stream(2, "w", errors="backslashreplace", line_buffering=True)


def _child(spec: dict, out: int) -> None:
    """The process that runs the code, once nothing but the sandbox is left to it."""
    _name(NAMES["child"])
    try:
        os.setsid()
        _drop_privileges(spec["uid"])
    except (OSError, SetupError) as exc:
        _fail(out, "user", exc)
    _run_as_python(spec, out)


def _run_as_python(spec: dict, out: int) -> NoReturn:
    """The request's code with its environment, output and descriptors, as a fresh interpreter."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
    except OSError as exc:
        _fail(out, "descriptors", exc)
    # Python's own additions at start-up (LC_CTYPE under PEP 538) stay, as in a fresh interpreter.
    added = {name: os.environ[name] for name in ("LC_CTYPE",) if name in os.environ}
    os.environ.clear()
    os.environ.update({**added, **spec["env"], "PWD": os.getcwd()})
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    _standard_streams()
    random.seed()  # a fresh interpreter seeds from the OS; a fork would repeat the server's state
    os._exit(_run(spec["run"]))


def _run(run: dict) -> int:
    """``python -c CODE ARGS`` or ``python -m MODULE ARGS``, with Python's exit status rules."""
    try:
        try:
            # sys.path[0] as python sets it: "" for -c, the working directory for -m.
            if "code" in run:
                sys.path.insert(0, "")
                sys.argv = ["-c", *run["args"]]
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(run["code"], "<string>", "exec"), main.__dict__)
            else:
                sys.path.insert(0, os.getcwd())
                sys.argv = [run["module"], *run["args"]]
                # A module the server imported runs afresh as __main__, as in a new interpreter; its
                # own imports stay warm.
                sys.modules.pop(run["module"], None)
                runpy.run_module(run["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - the interpreter's own report of an uncaught error
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken pipe loses nothing more
                pass
    return code & 0xFF


# ---- the server -----------------------------------------------------------------------------

# What a server serves: sandboxes (a request with a plan) or trusted runs (a request without).
SANDBOXES, TRUSTED = KINDS = ("sandboxes", "trusted")


def serve(control: socket.socket, trusted: bool) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
        except (ConnectionError, OSError):
            return
        if not message:
            return
        spec = _request(message)
        if len(fds) not in (2, 3) or spec is None or (spec["plan"] is None) != trusted:
            for fd in fds:  # the requester sees its reply socket close without a pid
                os.close(fd)
            continue
        reply, out, netns = socket.socket(fileno=fds[0]), fds[1], (fds[2] if len(fds) == 3 else None)
        if os.fork() == 0:
            control.close()
            try:
                _monitor(spec, reply, out, netns)
            except BaseException as exc:  # noqa: BLE001 - a bug here must not return into the server's loop
                _fail(out, "monitor", exc)
            finally:
                os._exit(EXIT_SETUP)
        reply.close()
        os.close(out)
        if netns is not None:
            os.close(netns)


def _request(message: bytes) -> dict | None:
    try:
        spec = json.loads(message)
    except ValueError:
        return None
    return spec if isinstance(spec, dict) and "plan" in spec else None


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[0]))
    if argv[1] not in KINDS:
        raise SystemExit(f"the second argument is the kind of requests served: {' or '.join(KINDS)}")
    trusted = argv[1] == TRUSTED
    _name(NAMES["server"])
    for name in argv[2:]:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # what the imports made stays put: the forks share those pages instead of copying them
    problem = _probe()
    control.send(b"ready" if problem is None else f"unable: {problem}".encode())
    if problem is None:
        serve(control, trusted)


def _probe() -> str | None:
    """Whether a fork here can make the namespaces a sandbox needs; why not, if not."""
    pid = os.fork()
    if pid == 0:
        try:
            _unshare(_namespace_flags(network=False))
            os._exit(0)
        except SetupError as exc:
            os.write(2, f"{exc}\n".encode())
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if status == 0 else "cannot create namespaces here (unshare refused)"


if __name__ == "__main__":
    main(sys.argv[1:])
