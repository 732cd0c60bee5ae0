"""A cgroup per sandboxed child, where the OS lets the grader make one: the figures the kernel keeps
about a process tree, read from outside it.

Sessions and process groups can be left (``setsid``, double fork); a cgroup cannot. Where the
controllers are writable (cgroup v1 hierarchies, or a delegated v2 subtree), every descendant of the
child belongs to the jail, and the kernel keeps for all of them together:

- ``pids``: the tasks, counted and killed through it; ``pids.max`` stops a fork bomb in the kernel;
- ``memory``: usage and its peak, pages of tmpfs files (the sandbox's /job, /tmp, /dev/shm)
  included, with a hard limit and a count of the processes the kernel killed for it. The peak is
  the figure a memory item is judged on: nothing the child does lowers it, and it includes every
  thread and process of the child, which no instrument inside the process can promise;
- ``freezer``: stop every task at once (a child that must not run while another is timed).

Where a controller is missing the jail works without it and says so (``peak_bytes`` is None):
the sandbox then falls back to its session-based watchdog and sampled resident memory.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
# Threads count as tasks for pids.max; this bounds a fork bomb without starving thread pools.
TASK_LIMIT = 2048
PREFIX = "fastdl-"
V1_CONTROLLERS = ("pids", "memory", "freezer")


def _own_paths() -> dict[str, str]:
    """This process's cgroup per v1 controller, and ``""`` for the v2 hierarchy."""
    found = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found[""] = path
        for controller in controllers.split(","):
            found[controller] = path
    return found


def _v1_parent(controller: str, own: dict[str, str]) -> Path | None:
    """Where a jail's cgroup of ``controller`` goes: inside this process's own one, so that what the
    sandbox uses counts towards whatever limit the grader itself runs under."""
    base = ROOT / controller
    if controller not in own or not (base / "cgroup.procs").exists():
        return None
    parent = base / own[controller].lstrip("/")
    return parent if parent.is_dir() else None


def _v2_parent(own: dict[str, str]) -> Path | None:
    # A v2 cgroup that holds processes cannot have children with controllers: the jail is a sibling.
    if not (ROOT / "cgroup.controllers").exists() or "" not in own:
        return None
    path = Path(own[""].lstrip("/"))
    return ROOT / path.parent if path.name else None


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Jail:
    """One child's cgroups: ``dirs`` maps a controller (``pids``, ``memory``, ``freezer``, or ``v2``
    for the unified hierarchy) to its folder."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    @property
    def path(self) -> Path:
        """The folder whose ``cgroup.procs`` lists the child's tasks."""
        return self.dirs.get("v2") or self.dirs.get("pids") or next(iter(self.dirs.values()))

    @property
    def procs_files(self) -> list[str]:
        """Every ``cgroup.procs`` a process writes its pid into to enter the jail."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    @classmethod
    def create(cls, memory_limit: int | None = None) -> "Jail | None":
        """A fresh jail, with ``memory_limit`` bytes as the kernel's hard limit where there is a
        memory controller; None where no cgroup can be made here."""
        own, name = _own_paths(), PREFIX + uuid.uuid4().hex[:12]
        dirs: dict[str, Path] = {}
        v2 = _v2_parent(own)
        if v2 is not None and v2.is_dir():
            _write(v2 / "cgroup.subtree_control", "+pids +memory")  # a delegated subtree allows this
            if _make(v2 / name):
                dirs["v2"] = v2 / name
        if not dirs:
            for controller in V1_CONTROLLERS:
                parent = _v1_parent(controller, own)
                if parent is not None and _make(parent / name):
                    dirs[controller] = parent / name
        if not dirs:
            return None
        jail = cls(dirs)
        tasks = jail._file("pids", "pids.max")
        if tasks is not None:
            _write(tasks, str(TASK_LIMIT))
        if memory_limit:
            jail.limit_memory(memory_limit)
        return jail

    @classmethod
    def of_this_process(cls) -> "Jail | None":
        """The jail this process was started in, if any (nbgrader's run is in one)."""
        own, dirs = _own_paths(), {}
        for controller, path in own.items():
            if not Path(path).name.startswith(PREFIX):
                continue
            if controller == "":
                dirs["v2"] = ROOT / path.lstrip("/")
            elif controller in V1_CONTROLLERS:
                dirs[controller] = ROOT / controller / path.lstrip("/")
        return cls(dirs) if dirs else None

    def _file(self, controller: str, name: str) -> Path | None:
        folder = self.dirs.get(controller) or self.dirs.get("v2")
        if folder is None:
            return None
        path = folder / name
        return path if path.exists() else None

    def enter(self) -> None:
        """Called in the child before exec: the child and all it starts belong to the jail."""
        for procs in self.procs_files:
            Path(procs).write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    # --- memory -------------------------------------------------------------------------------

    def limit_memory(self, limit: int) -> bool:
        path = self._file("memory", "memory.limit_in_bytes") or self._file("memory", "memory.max")
        return path is not None and _write(path, str(int(limit)))

    def memory_bytes(self) -> int | None:
        path = self._file("memory", "memory.usage_in_bytes") or self._file("memory", "memory.current")
        return _read_int(path) if path else None

    def peak_bytes(self) -> int | None:
        """The most memory the jail's tasks ever held at once, as the kernel counted it; None
        without a memory controller (or a v2 kernel older than memory.peak)."""
        path = self._file("memory", "memory.max_usage_in_bytes") or self._file("memory", "memory.peak")
        return _read_int(path) if path else None

    def oom_kills(self) -> int:
        """How many of the jail's processes the kernel killed for its memory limit."""
        for name in ("memory.oom_control", "memory.events"):
            path = self._file("memory", name)
            if path is None:
                continue
            try:
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
            except (OSError, ValueError):
                return 0
        return 0

    # --- freezing -----------------------------------------------------------------------------

    def freeze(self, frozen: bool = True) -> bool:
        """Stop (or resume) every task of the jail at once; False where no freezer is available."""
        state = self._file("freezer", "freezer.state")
        if state is not None:
            if not _write(state, "FROZEN" if frozen else "THAWED"):
                return False
            return self._settled(state, "FROZEN" if frozen else "THAWED")
        knob = self._file("v2", "cgroup.freeze")
        if knob is not None and _write(knob, "1" if frozen else "0"):
            return self._settled(self._file("v2", "cgroup.events"), f"frozen {int(frozen)}")
        return False

    @staticmethod
    def _settled(path: Path | None, wanted: str, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while path is not None and time.monotonic() < deadline:
            try:
                if wanted in path.read_text():
                    return True
            except OSError:
                return False
            time.sleep(0.001)
        return path is None

    # --- the end ------------------------------------------------------------------------------

    def kill_all(self) -> None:
        self.freeze(False)  # a frozen task cannot die
        for _ in range(100):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.02)
        for folder in self.dirs.values():
            try:
                folder.rmdir()
            except OSError:
                pass


def _make(path: Path) -> bool:
    try:
        path.mkdir()
        return True
    except OSError:
        return False
