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

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from autograder.engine import bwrap

SCRIPT = str(Path(__file__).with_name("forkserver.py"))
# What every grading child imports before any of the course: torch (about 2 s on a 2-core
# machine), and what building an optimizer or a Triton kernel pulls in (torch._dynamo, about 1 s).
PRELOAD = ("torch", "numpy", "triton", "torch._dynamo")
START_S = 120
REPLY_BYTES = 4096
ENV_SWITCH = "FASTDL_PREFORK"
# Children forked by this process's servers so far (the grading benchmark says which way it ran).
forked_total = 0


class Unavailable(RuntimeError):
    """The fork server could not be started or stopped answering; children use bubblewrap."""


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class Forked:
    """A child of the fork server, seen through the few methods ``run_sandboxed`` uses of a Popen:
    ``pid`` (its monitor, a session leader), ``stdout``, ``poll``, ``wait`` and ``returncode``."""

    def __init__(self, pid: int, reply: socket.socket, stdout):
        self.pid, self.stdout, self.returncode = pid, stdout, None
        self._reply = reply

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

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(block=False)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self._receive(block=True)
        return self.returncode


def python_target(argv: list[str]) -> dict:
    """What ``python -c CODE ARGS`` or ``python -m MODULE ARGS`` runs, as the server's request."""
    if len(argv) >= 3 and argv[1] == "-c":
        return {"code": argv[2], "args": argv[3:]}
    if len(argv) >= 3 and argv[1] == "-m":
        return {"module": argv[2], "args": argv[3:]}
    raise ValueError(f"the fork server runs python -c or python -m, not {argv[:3]}")


class ForkServer:
    def __init__(self, env: dict[str, str]):
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        # A file, not a pipe nobody reads while the server runs: a warning it prints cannot block it.
        errors = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [bwrap.PYTHON, "-P", SCRIPT, str(theirs.fileno()), *PRELOAD], env=env, cwd="/",
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
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

    def spawn(self, argv: list[str], *, view: bwrap.View, env: dict[str, str], rlimits: dict,
              jail: str | None) -> Forked:
        spec = {"plan": bwrap.plan(view), "chdir": bwrap.JOB, "hostname": bwrap.HOSTNAME,
                "network": view.network, "uid": bwrap.NOBODY, "rlimits": rlimits, "jail": jail,
                "env": env, "run": python_target(argv)}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read_end, write_end = os.pipe()
        try:
            with self._lock:
                socket.send_fds(self._control, [json.dumps(spec).encode()], [theirs.fileno(), write_end])
            ours.settimeout(START_S)
            started = ours.recv(REPLY_BYTES)
        except OSError as exc:
            ours.close()
            os.close(read_end)
            raise Unavailable(f"the fork server stopped answering: {exc}") from None
        finally:
            theirs.close()
            os.close(write_end)
        if not started:
            ours.close()
            os.close(read_end)
            raise Unavailable("the fork server stopped answering")
        ours.settimeout(None)
        global forked_total
        forked_total += 1
        return Forked(json.loads(started)["pid"], ours, open(read_end, "rb"))

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        self._control.close()  # the server exits at end of input
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_servers: dict[tuple, ForkServer] = {}
_broken: set[tuple] = set()
_owner = os.getpid()
_guard = threading.Lock()


def server_for(env: dict[str, str], *, gpu: bool) -> ForkServer | None:
    """This process's fork server for children with environment ``env``, started on first use;
    None where children must start through bubblewrap instead. GPU profiles start cold: a fork
    from a process in which anything has initialised CUDA cannot use the GPU, and that the
    imports leave CUDA untouched has not been measured on a GPU host yet."""
    global _owner
    if gpu or not enabled():
        return None
    key = tuple(sorted(env.items()))
    with _guard:
        if _owner != os.getpid():  # a forked grading worker never shares its parent's servers
            _servers.clear()
            _owner = os.getpid()
        server = _servers.get(key)
        if server is not None and server.alive():
            return server
        if key in _broken:
            return None
        try:
            server = _servers[key] = ForkServer(env)
        except (OSError, Unavailable) as exc:
            _broken.add(key)
            print(f"fastdl: children start through bubblewrap ({exc})", file=sys.stderr)
            return None
        return server
