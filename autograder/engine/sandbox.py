"""Run untrusted code in a child process with limits, and say in one word how it ended.

With a ``bwrap.View`` the child runs isolated (``bwrap.py``: own namespaces, unprivileged uid,
nothing of the course visible). Either way it gets its own session, a pids cgroup where the OS
allows one, CPU-time and address-space rlimits, and a capped output pipe. A watchdog in the
parent enforces what rlimits cannot: wall time, resident memory of every descendant, the number
of processes, and the output cap. Nothing here imports the child's code.
"""

from __future__ import annotations

import os
import resource
import select
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from autograder.engine import bwrap, prefork
from autograder.engine.forkserver import PR_SET_PDEATHSIG, libc, private_network
from autograder.engine.jail import Jail
from autograder.engine.prefork import Forked, ForkServer, Unavailable

PAGE = os.sysconf("SC_PAGE_SIZE")
# bubblewrap's monitor and the init of the pid namespace it creates.
SANDBOX_PROCESSES = 2
# A trusted run forked warm: its monitor.
TRUSTED_PROCESSES = 1
# How often the watchdog samples a child's processes and their memory.
SAMPLE_S = 0.05
# The process name of bubblewrap's own processes (its monitor and its pid namespace's init).
BWRAP_NAME = "bwrap"
# Memory a child may hold in its tmpfs folders beyond the resident-memory limit.
CGROUP_SLACK_BYTES = 1 << 30


@dataclass
class Limits:
    wall_s: float = 120.0
    cpu_s: float = 240.0
    memory_bytes: int = 6 << 30
    # Address-space limits break CUDA (it reserves terabytes of virtual memory); GPU profiles
    # turn this off and rely on the resident-memory watchdog alone.
    limit_address_space: bool = True
    max_processes: int = 16
    output_bytes: int = 256 << 10
    isolate_network: bool = True
    # A private network namespace starts with loopback down. Jupyter kernels and gloo ranks
    # talk over 127.0.0.1, so children that need that get loopback (and nothing else).
    loopback: bool = False
    # How often the watchdog samples the child's processes and memory (every sample reads the
    # process table several times). A world's rank children, many at once and each in a jail
    # whose kernel limits stop a fork bomb or a spike, are sampled less often.
    sample_s: float = 0.05


@dataclass
class ChildResult:
    """How a sandboxed child ended. ``status`` is one word; ``reason`` is for people."""

    status: str  # ok | error | timeout | cpu_time | memory | processes | output | crashed
    reason: str
    returncode: int | None
    wall_s: float
    output_tail: str = ""
    network_isolated: bool = False
    jailed: bool = False  # in a pids cgroup
    sandboxed: bool = False  # in bubblewrap's namespaces as an unprivileged uid
    forked: bool = False  # forked from a warm interpreter (prefork.py), not started by bubblewrap
    # The most memory the child's whole tree held at once: the kernel's own figure where the jail
    # has a memory controller (``peak_source`` "cgroup"), else the watchdog's largest sample of
    # resident memory ("sampled", which a spike between two samples escapes).
    peak_bytes: int = 0
    peak_source: str = "sampled"
    # The most processes of the child's own at once (the program the sandbox runs and every process
    # it started; not the sandbox's launchers), as the watchdog saw them every ``SAMPLE_S`` seconds:
    # a figure the child can raise by starting processes, never lower once they ran that long.
    processes: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def die_with_parent() -> None:
    """The kernel kills this process when its parent dies: an interrupted grader leaves nothing."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _process_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every process that is still there when read."""
    table = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # it exited between the listing and the read
        # The fields after the parenthesised command name (which may hold spaces): state, ppid,
        # process group, session.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 3:
            table.append((int(entry), int(fields[1]), int(fields[3])))
    return table


def _fork_helpers(table: list[tuple[int, int, int]] | None = None) -> set[int]:
    """The monitors and inits of sandboxes forked by this process's fork servers (a kernel's
    too): copies of the warm interpreter that run no student code, whose pages are counted once,
    in the child they share them with. Known by parentage, which no student process can take on."""
    servers = prefork.server_pids()
    if not servers:
        return set()
    table = _process_table() if table is None else table
    monitors = {pid for pid, parent, _ in table if parent in servers}
    sandboxed = monitors - prefork.trusted_monitors()
    return monitors | {pid for pid, parent, _ in table if parent in sandboxed}


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def own_processes(pids: list[int], helpers: set[int]) -> list[int]:
    """The processes of a child's tree that are the child's own: not the fork server's monitors
    and inits (``helpers``), not bubblewrap's. A process can rename itself only to hide."""
    return [pid for pid in pids if pid not in helpers and _name(pid) != BWRAP_NAME]


def children(parent: int) -> list[int]:
    """The processes whose parent is ``parent``."""
    return [pid for pid, ppid, _ in _process_table() if ppid == parent]


def _session_pids(sid: int, table: list[tuple[int, int, int]] | None = None) -> list[int]:
    return [pid for pid, _, session in (_process_table() if table is None else table) if session == sid]


def descendants(root: int, table: list[tuple[int, int, int]] | None = None) -> list[int]:
    """``root`` and every process below it: a sandbox's processes sit in sessions of their own.
    ``table``: a process table already read (``_process_table``), else it is read now."""
    children: dict[int, list[int]] = {}
    for pid, parent, _ in (_process_table() if table is None else table):
        children.setdefault(parent, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def _kill_session(sid: int) -> None:
    for pid in _session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    cpu = max(1, int(limits.cpu_s))
    found = {"RLIMIT_CPU": (cpu, cpu + 5), "RLIMIT_CORE": (0, 0)}
    if limits.limit_address_space:
        found["RLIMIT_AS"] = (limits.memory_bytes, limits.memory_bytes)
    return found


def run_sandboxed(
    argv: list[str], *, limits: Limits, cwd: str, env: dict[str, str], view: bwrap.View | None = None,
    server: ForkServer | None = None, started=None,
) -> ChildResult:
    """Run ``argv`` under ``limits`` (isolated as ``view`` says, if given); never raises for
    anything the child does. With a ``server`` (and a ``view``), a
    ``python -c``/``-m`` argv runs in a child forked from that warm interpreter (``prefork.py``)
    in the same sandbox, else through bubblewrap. Without a view, a ``server`` forks a trusted
    program (nbgrader's run) with the session, jail, limits and network it would get here.
    ``started(jail)``, if given, is called once the child runs (the jail is None where the OS lets
    the grader make none): the caller may freeze it while another child is timed."""
    marker = os.path.join(cwd, ".network")
    # The kernel's limit is the watchdog's with room for what the sandbox keeps in its own tmpfs
    # folders (counted by the cgroup, invisible to resident memory): it ends a spike between two
    # samples, which the watchdog alone would miss.
    jail = Jail.create(memory_limit=limits.memory_bytes + CGROUP_SLACK_BYTES)
    start = time.monotonic()
    if server is not None:
        jailed = jail.procs_files if jail else None
        try:
            if view is not None:
                proc = server.spawn(argv, view=view, env=env, rlimits=_rlimits(limits), jail=jailed)
            else:
                proc = server.run_trusted(argv, cwd=cwd, env=env, rlimits=_rlimits(limits), jail=jailed,
                                          isolate_network=limits.isolate_network, loopback=limits.loopback,
                                          marker=marker)
        except Unavailable:
            proc = None  # the server died: this child starts cold, and the next asks for a new server
        if proc is not None:
            if started is not None:
                started(jail)
            return _watch(proc, start, limits, view, jail, marker)
    if view is not None:
        argv = bwrap.command(argv, view)

    def preexec() -> None:
        os.setsid()
        die_with_parent()
        if jail is not None:
            jail.enter()
        for name, value in _rlimits(limits).items():
            resource.setrlimit(getattr(resource, name), value)
        # bubblewrap makes its own network namespace (unless the view shares the caller's).
        if view is None and limits.isolate_network:
            private_network(limits.loopback, marker)

    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=preexec,
    )
    if started is not None:
        started(jail)
    return _watch(proc, start, limits, view, jail, marker)


def _wait_ended(proc, seconds: float) -> None:
    """Sleep until the next sample, or until the child has ended, whichever comes first: a short
    child is then seen to end at once, not up to a sample later."""
    if isinstance(proc, Forked):
        ended = proc.ended_fd()  # the monitor reports the end on it
    else:
        try:
            ended = os.pidfd_open(proc.pid)
        except OSError:
            time.sleep(seconds)
            return
    try:
        select.select([ended], [], [], seconds)
    except (OSError, ValueError):
        time.sleep(seconds)
    finally:
        if not isinstance(proc, Forked):
            os.close(ended)


def _watch(proc, start: float, limits: Limits, view: bwrap.View | None, jail: Jail | None, marker: str) -> ChildResult:
    """The watchdog over a started child (a Popen, or a ``prefork.Forked``) until it ends."""
    sid = proc.pid
    forked = isinstance(proc, Forked)
    verdict: list[tuple[str, str]] = []
    tail = bytearray()
    seen = 0

    def read_output() -> None:
        nonlocal seen
        while chunk := proc.stdout.read1(65536):
            seen += len(chunk)
            tail.extend(chunk)
            del tail[: max(0, len(tail) - 8192)]
            if seen > limits.output_bytes and not verdict:
                verdict.append(("output", f"output limit exceeded: more than {limits.output_bytes} bytes printed"))
                _kill_session(sid)

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    sampled_peak = 0
    processes = 0
    while proc.poll() is None:
        elapsed = time.monotonic() - start
        if elapsed > limits.wall_s and not verdict:
            verdict.append(("timeout", f"wall-time limit of {limits.wall_s:.0f} s exceeded (a loop that never ends?)"))
        # One reading of /proc per sample serves all three questions: with a dozen children
        # watched at once, each reading of a few hundred processes' stat files adds up.
        table = _process_table()
        pids = sorted(set(_session_pids(sid, table)) | set(descendants(sid, table)) | set(jail.pids() if jail else ()))
        allowed = limits.max_processes + (SANDBOX_PROCESSES if view is not None else TRUSTED_PROCESSES if forked else 0)
        if len(pids) > allowed and not verdict:
            verdict.append(("processes", f"process limit exceeded: {len(pids)} processes (limit {limits.max_processes})"))
        helpers = _fork_helpers(table)
        resident = _resident_bytes([pid for pid in pids if pid not in helpers])
        sampled_peak = max(sampled_peak, resident)
        processes = max(processes, len(own_processes(pids, helpers)))
        if resident > limits.memory_bytes and not verdict:
            verdict.append(("memory", f"memory limit exceeded: {resident >> 20} MiB resident (limit {limits.memory_bytes >> 20} MiB)"))
        if verdict:
            _kill_session(sid)
            break
        _wait_ended(proc, limits.sample_s)
    proc.wait()
    # Whatever the child left running goes too: its session, and anything that left the session.
    _kill_session(sid)
    peak, oom = (jail.peak_bytes(), jail.oom_kills()) if jail is not None else (None, 0)
    if jail is not None:
        jail.kill_all()
    reader.join(timeout=5)
    wall = time.monotonic() - start
    output = tail.decode("utf-8", "replace")
    isolated = (view is not None and not view.network) or os.path.exists(marker)
    rc = proc.returncode
    if (view is not None or forked) and rc is not None and 128 < rc < 128 + 65:
        rc = -(rc - 128)  # bubblewrap and a fork's monitor report a child killed by signal N as 128 + N
    if verdict:
        status, reason = verdict[0]
    elif oom:
        status, reason = "memory", (f"memory limit exceeded: the kernel stopped the process at "
                                    f"{(peak or 0) >> 20} MiB (limit {limits.memory_bytes >> 20} MiB)")
    elif rc == 0:
        status, reason = "ok", ""
    elif rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            status, reason = "cpu_time", f"CPU-time limit of {limits.cpu_s:.0f} s exceeded"
        else:
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            status, reason = "crashed", f"process crashed with {name} (e.g. an abort or an out-of-bounds access)"
    elif "MemoryError" in output[-2000:]:
        status, reason = "memory", f"memory limit exceeded (MemoryError under a {limits.memory_bytes >> 20} MiB limit)"
    else:
        status, reason = "error", f"exited with code {rc}"
    return ChildResult(status, reason, rc, wall, output, isolated, jail is not None, view is not None, forked,
                       peak_bytes=peak if peak is not None else sampled_peak,
                       peak_source="cgroup" if peak is not None else "sampled", processes=processes)
