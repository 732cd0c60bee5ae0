"""Sandboxed children forked from a warm interpreter (``forkserver.py``) instead of started cold.

One fork server per distinct environment is started on first use in each grading process and
lives as long as it; ``run_sandboxed`` asks it for a child when it is given one. Each request
sends the same filesystem plan bubblewrap would get (``bwrap.plan``), the limits that a fresh
child would set before its exec, the environment, and the code. What the child sees from inside
is what a bubblewrap child sees (``tests/test_isolation.py`` runs every check against both).

Where ``FASTDL_PREFORK=0`` is set, the profile has a GPU, or the server cannot start (it cannot
make namespaces here, say), ``server_for`` returns None and children start through bubblewrap as
before.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import shutil
import tempfile
import threading
from pathlib import Path

from autograder.engine import bwrap
from autograder.engine.forkserver import SANDBOXES, TRUSTED

SCRIPT = str(Path(__file__).with_name("forkserver.py"))
# What every grading child imports before any of the course: torch (about 2 s on a 2-core
# machine), and what building an optimizer or a Triton kernel pulls in (torch._dynamo, about 1 s).
PRELOAD = ("torch", "numpy", "triton", "torch._dynamo")
# What nbgrader's kernel imports before the notebook's first cell has run, what every lab's first
# cells import, and what a notebook's first torch.compile or C++ build imports (inductor's compiler
# and torch.utils.cpp_extension: about 1.3 s of lab 02's first compile). Not matplotlib: importing
# it makes the config folder its environment names (MPLCONFIGDIR, inside the sandbox), and the
# server runs outside, on the grader's filesystem.
KERNEL_PRELOAD = ("torch", "numpy", "torch._dynamo", "ipykernel.kernelapp", "torch._inductor.compile_fx",
                  "torch._dynamo.backends.inductor", "torch.utils.cpp_extension")
# What nbgrader's own process imports before it starts the notebook's kernel (0.9-1.1 s on the idle
# 2-core machine, paid by every submission when that process starts cold): its command line, the
# autograde converter, the kernel client and the gradebook's database layer.
NBGRADER_PRELOAD = ("autograder.nbgrader_main", "nbgrader.converters.autograde", "nbclient",
                    "jupyter_client.manager", "sqlalchemy.orm", "alembic.command")
# Set for nbgrader's run: the socket its kernel launcher (kernel_jail.py) asks for a warm kernel on.
KERNEL_RELAY_VAR = "FASTDL_KERNEL_RELAY"
START_S = 120
REPLY_BYTES = 4096
# How long a monitor that has reported its sandbox's end may take to exit.
GONE_S = 5
ENV_SWITCH = "FASTDL_PREFORK"
# Children forked by this process's servers so far, kernels forked for nbgrader's runs, and
# trusted runs (nbgrader's own process) among the children (the grading benchmark says which way
# it ran).
forked_total = 0
kernels_total = 0
trusted_total = 0


class Unavailable(RuntimeError):
    """The fork server could not be started or stopped answering; children use bubblewrap."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class Forked:
    """A child of the fork server, seen through the few methods ``run_sandboxed`` uses of a Popen:
    ``pid`` (its monitor, a session leader), ``stdout``, ``poll``, ``wait`` and ``returncode``."""

    def __init__(self, pid: int, reply: socket.socket, stdout, trusted: bool = False):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._reply = reply
        if trusted:
            _trusted_monitors.add(pid)
        try:
            self._gone = os.pidfd_open(pid)  # the monitor's end, which follows everything in its sandbox
        except OSError:
            self._gone = None  # already ended

    def _receive(self, block: bool) -> None:
        self._reply.setblocking(block)
        try:
            message = self._reply.recv(REPLY_BYTES)
        except BlockingIOError:
            return
        except OSError:
            message = b""
        # A monitor that ends without a word was killed (the watchdog kills with SIGKILL).
        self.returncode = json.loads(message)["exit"] if message else 128 + 9
        self._reply.close()
        _trusted_monitors.discard(self.pid)
        if self._gone is not None:  # ended means no process of the sandbox is left
            select.select([self._gone], [], [], GONE_S)
            os.close(self._gone)

    def ended_fd(self):
        """What becomes readable when the sandbox ends (the monitor's report): for ``select``."""
        return self._reply

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(block=False)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self._receive(block=True)
        return self.returncode

    def kill(self) -> None:
        """Ends the sandbox: its init dies with the monitor, and every process in it with the init."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


def python_target(argv: list[str]) -> dict:
    """What ``python -c CODE ARGS`` or ``python -m MODULE ARGS`` runs, as the server's request."""
    if len(argv) >= 3 and argv[1] == "-c":
        return {"code": argv[2], "args": argv[3:]}
    if len(argv) >= 3 and argv[1] == "-m":
        return {"module": argv[2], "args": argv[3:]}
    raise ValueError(f"the fork server runs python -c or python -m, not {argv[:3]}")


def _spec(argv: list[str], view: bwrap.View, env: dict[str, str], rlimits: dict, jail: list[str] | None,
          label: str) -> dict:
    return {"plan": bwrap.plan(view), "chdir": bwrap.JOB, "hostname": bwrap.HOSTNAME, "network": view.network,
            "uid": bwrap.NOBODY, "rlimits": rlimits, "jail": jail, "env": env, "run": python_target(argv),
            "label": label}


def _trusted_spec(argv: list[str], cwd: str, env: dict[str, str], rlimits: dict, jail: list[str] | None, *,
                  isolate_network: bool, loopback: bool, marker: str) -> dict:
    return {"plan": None, "chdir": cwd, "network": not isolate_network, "loopback": loopback, "marker": marker,
            "rlimits": rlimits, "jail": jail, "env": env, "run": python_target(argv), "label": "trusted"}


def _started(ours: socket.socket, stdout, trusted: bool = False) -> Forked:
    """The child once its monitor has said its pid on ``ours``; Unavailable if nobody does."""
    ours.settimeout(START_S)
    try:
        started = ours.recv(REPLY_BYTES)
    except OSError:
        started = b""
    if not started:
        ours.close()
        if stdout is not None:
            stdout.close()
        raise Unavailable("the fork server stopped answering")
    ours.settimeout(None)
    global forked_total, trusted_total
    forked_total += 1
    trusted_total += trusted
    return Forked(json.loads(started)["pid"], ours, stdout, trusted)


class ForkServer:
    """A fork server of sandboxes, or with ``trusted`` of trusted runs only: such a server may have
    imported the grader's own modules (nbgrader's imports ``autograder``), which no sandbox may
    find in its memory, so the two kinds never serve each other's requests."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD, *, trusted: bool = False):
        self.trusted = trusted
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        # A file, not a pipe nobody reads while the server runs: a warning it prints cannot block it.
        errors = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [bwrap.PYTHON, "-P", SCRIPT, str(theirs.fileno()), TRUSTED if trusted else SANDBOXES, *preload],
                env=env, cwd="/", pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=errors, start_new_session=True)
        finally:
            theirs.close()
        self._control.settimeout(START_S)
        try:
            ready = self._control.recv(REPLY_BYTES)
        except OSError:
            ready = b""
        self._control.settimeout(None)
        if ready != b"ready":
            self.close()
            errors.seek(0)
            detail = ready.decode(errors="replace") or (
                errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no answer"])[0]
            raise Unavailable(f"the fork server did not start: {detail[:300]}")
        errors.close()
        _live[self._proc.pid] = self

    def spawn(self, argv: list[str], *, view: bwrap.View, env: dict[str, str], rlimits: dict,
              jail: list[str] | None) -> Forked:
        if self.trusted:
            raise ValueError("a server of trusted runs forks no sandbox")
        return self._request(_spec(argv, view, env, rlimits, jail, "item"))

    def run_trusted(self, argv: list[str], *, cwd: str, env: dict[str, str], rlimits: dict, jail: list[str] | None,
                    isolate_network: bool, loopback: bool, marker: str) -> Forked:
        """``argv`` forked warm as a trusted run (``forkserver.py``): no sandbox, the grader's uid."""
        if not self.trusted:
            raise ValueError("a server of sandboxes forks no trusted run")
        return self._request(_trusted_spec(argv, cwd, env, rlimits, jail, isolate_network=isolate_network,
                                           loopback=loopback, marker=marker))

    def _request(self, spec: dict) -> Forked:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read_end, write_end = os.pipe()
        try:
            self.forward(json.dumps(spec).encode(), [theirs.fileno(), write_end])
        except Unavailable:
            ours.close()
            os.close(read_end)
            raise
        finally:
            theirs.close()
            os.close(write_end)
        return _started(ours, open(read_end, "rb"), trusted=spec["plan"] is None)

    def forward(self, request: bytes, fds: list[int]) -> None:
        """Hands the server one request and its descriptors (it keeps copies)."""
        try:
            with self._lock:
                socket.send_fds(self._control, [request], fds)
        except OSError as exc:
            raise Unavailable(f"the fork server stopped answering: {exc}") from None

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        _live.pop(self._proc.pid, None)
        self._control.close()  # the server exits at end of input
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_servers: dict[tuple, ForkServer] = {}
_live: dict[int, "ForkServer"] = {}  # every started server of this process, by pid
_broken: set[tuple] = set()
# Monitors of trusted runs not yet ended: their child is the program itself, not a sandbox's init.
_trusted_monitors: set[int] = set()
_owner = os.getpid()
_guard = threading.Lock()


def server_pids() -> set[int]:
    """This process's fork servers: their children are sandboxes' monitors, whose children are
    the sandboxes' inits (a parentage no student process can take on)."""
    return set(_live) if _owner == os.getpid() else set()


def trusted_monitors() -> set[int]:
    """Monitors of this process's trusted runs: the one process below each is the run's program,
    whose memory counts (``sandbox._fork_helpers``)."""
    return set(_trusted_monitors) if _owner == os.getpid() else set()


def server_for(env: dict[str, str], *, gpu: bool, preload: tuple[str, ...] = PRELOAD,
               trusted: bool = False) -> ForkServer | None:
    """This process's fork server for children with environment ``env``, started on first use;
    None where children must start through bubblewrap instead. GPU profiles start cold: a fork
    from a process in which anything has initialised CUDA cannot use the GPU, and that the
    imports leave CUDA untouched has not been measured on a GPU host yet."""
    global _owner
    if gpu or not enabled():
        return None
    key = (tuple(sorted(env.items())), preload, trusted)
    with _guard:
        if _owner != os.getpid():  # a forked grading worker never shares its parent's servers
            _servers.clear()
            _live.clear()
            _trusted_monitors.clear()
            _owner = os.getpid()
        server = _servers.get(key)
        if server is not None and server.alive():
            return server
        if key in _broken:
            return None
        try:
            server = _servers[key] = ForkServer(env, preload, trusted=trusted)
        except (OSError, Unavailable) as exc:
            _broken.add(key)
            print(f"fastdl: children start through bubblewrap ({exc})", file=sys.stderr)
            return None
        return server


# ---- nbgrader's kernels ----------------------------------------------------------------------
#
# nbgrader's run is a process of its own, started fresh for every submission, and its kernel
# launcher (kernel_jail.py) a child of it: a server started there would pay its imports every
# time. So the grading process keeps the kernels' server too, and listens for the launcher's
# requests on a socket in a folder only its own uid can enter (never shown in any sandbox). A
# request is what ForkServer.spawn would send, with the launcher's reply socket, its standard
# error and its network namespace (nbgrader talks to its kernel over loopback there).

_relay: tuple[int, str] | None = None  # (the process that opened it, its path)


def kernel_relay() -> str | None:
    """The socket path nbgrader's kernel launcher asks for warm kernels on, opened on first use;
    None where kernels start through bubblewrap."""
    global _relay
    if not enabled():
        return None
    with _guard:
        if _relay is None or _relay[0] != os.getpid():
            folder = tempfile.mkdtemp(prefix="fastdl-relay-")
            path = os.path.join(folder, "kernels.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            listener.bind(path)
            listener.listen(8)
            threading.Thread(target=_relay_loop, args=(listener,), daemon=True, name="fastdl-kernel-relay").start()
            _relay = (os.getpid(), path)
            # The folder outlives nothing but its grading process; a fork of that process (a Dask
            # worker, a test's child) opens its own and must not take this one with it.
            atexit.register(_remove_relay_folder, os.getpid(), folder)
        return _relay[1]


def _remove_relay_folder(owner: int, folder: str) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def _relay_loop(listener: socket.socket) -> None:
    while True:
        connection, _ = listener.accept()
        with connection:
            try:
                request, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
            except OSError:
                continue
            try:
                spec = json.loads(request)
                env = spec["env"]
                # Only a kernel without a GPU is forked (see server_for), and only into a sandbox:
                # a launcher's request never becomes a trusted run.
                server = server_for(env, gpu=env.get("TRITON_INTERPRET") != "1", preload=KERNEL_PRELOAD)
                if server is not None and len(fds) == 3 and isinstance(spec["plan"], list):
                    server.forward(request, fds)
                    global kernels_total
                    kernels_total += 1
            except (ValueError, KeyError, TypeError, Unavailable):
                pass  # the launcher sees its reply socket close, and starts the kernel cold
            finally:
                for fd in fds:
                    os.close(fd)


def request_kernel(relay: str, argv: list[str], *, view: bwrap.View, env: dict[str, str], rlimits: dict,
                   jail: list[str] | None) -> Forked:
    """For nbgrader's kernel launcher: a kernel forked warm by the grading process's server,
    writing to this process's standard error, in this process's network namespace."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.settimeout(START_S)
            connection.connect(relay)
            socket.send_fds(connection, [json.dumps(_spec(argv, view, env, rlimits, jail, "kernel")).encode()],
                            [theirs.fileno(), 2, netns])
    except OSError as exc:
        ours.close()
        raise Unavailable(f"no kernel relay at {relay}: {exc}") from None
    finally:
        theirs.close()
        os.close(netns)
    return _started(ours, None)
