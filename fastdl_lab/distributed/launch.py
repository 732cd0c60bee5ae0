"""Start a small torch.distributed world on this machine, or join the one torchrun made (lab 07).

``run_world(fn, world_size, ...)`` forks ``world_size`` processes, joins them into one process
group and returns what ``fn(rank, world_size, ...)`` returned on each rank, so that a notebook
cell can run real collectives. Forked, not spawned: a function defined in a cell has no name
that a spawned process could import.

What it guarantees, because a student's rank will raise, hang and deadlock:

* every rank sets ``torch.set_num_threads(1)``: two ranks on two cores, each wanting a thread
  pool of its own, run several times slower than one thread each;
* rank 0 serves the rendezvous store on a port the OS picks in the same call that binds it, so
  no two worlds (threads, notebooks or graders at once) ever collide on a port. The parent runs
  no store of its own: forking a process whose store thread holds a lock leaves the child
  waiting on that lock forever (measured: one world in five of four ranks hung at rendezvous);
* every collective fails after ``timeout_s``; a rank that raises, dies or hangs brings the
  whole world down: all ranks are killed (also when the caller is interrupted, and by the kernel
  if the caller itself dies) and ``RankFailure`` names the rank and the reason;
* the call returns within ``2 * timeout_s + STARTUP_S`` whatever the ranks do;
* what a rank prints is shown in the caller's output, prefixed ``[rank r]``, as it happens.

Under torchrun (RANK and WORLD_SIZE in the environment) nothing is forked: ``run_world`` runs
``fn`` once, for this process's rank, in the group torchrun's variables describe (README, "Scaling
past one machine").
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import io
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import connection

import torch
import torch.distributed as dist

from fastdl_lab import device

# Forking, joining the group and the first import-free steps take well under a second; the
# margin is for a loaded machine.
STARTUP_S = 10.0
# What a rank may print before its output is cut, so that a loop of prints cannot flood the cell.
MAX_OUTPUT_CHARS = 20_000

# Which device this process's rank computes on; set when it joins a world.
_rank_device = torch.device("cpu")


class RankFailure(RuntimeError):
    """A rank of ``run_world`` raised, died or did not answer; every rank has been stopped."""

    def __init__(self, rank: int, reason: str, details: str = ""):
        self.rank = rank
        self.reason = reason
        self.details = details
        super().__init__(f"rank {rank} failed: {reason}" + (f"\n{details}" if details else ""))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a torchrun --master-port, say).

    Only a hint: another process may take it before it is used. ``run_world`` does not rely on
    it; rank 0's store binds port 0 itself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device() -> torch.device:
    """The device this rank's tensors belong on: its own GPU under NCCL, else the CPU."""
    return _rank_device


def _torchrun_env() -> tuple[int, int] | None:
    env = os.environ
    return (int(env["RANK"]), int(env["WORLD_SIZE"])) if "RANK" in env and "WORLD_SIZE" in env else None


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [_to_cpu(v) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value


def _destroy_if_initialized() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
        # The group's C++ threads stop only when its last reference goes, which may sit in a
        # reference cycle; collected during interpreter shutdown instead, a thread that then
        # reaches for the GIL is killed mid-C++ and the process aborts.
        gc.collect()


def _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout_s) -> list:
    global _rank_device
    rank, env_world = _torchrun_env()
    if env_world != world_size:
        raise ValueError(f"torchrun started {env_world} ranks but this call asks for {world_size}; "
                         f"launch with --nproc-per-node/--nnodes giving {world_size} in all")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        chosen = backend or ("nccl" if device.has_gpu() else "gloo")
        if chosen == "nccl":
            torch.cuda.set_device(local_rank)
        # The group stays up for the life of the process, as torchrun scripts expect: the next
        # run_world call reuses it instead of rendezvousing again on the same port. It must be
        # torn down before the interpreter exits: a gloo group left to the C++ destructors at
        # exit aborts the process now and then ("terminate called without an active exception").
        dist.init_process_group(chosen, init_method="env://", timeout=timedelta(seconds=timeout_s))
        atexit.register(_destroy_if_initialized)
    if dist.get_backend() == "nccl":
        _rank_device = torch.device("cuda", local_rank)
    results: list = [None] * world_size
    results[rank] = fn(rank, world_size, *args, **kwargs)
    return results


def _check_nccl_fork(world_size: int) -> None:
    # NCCL refuses two ranks on one GPU. And a forked child cannot use CUDA once the parent has
    # initialised the driver; torch.cuda.is_available() does that unless
    # PYTORCH_NVML_BASED_CUDA_CHECK=1 was set first, and nothing can tell afterwards.
    if torch.cuda.device_count() < world_size:
        raise ValueError(f"NCCL needs a GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPU(s)")
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is initialised in this process, so forked ranks cannot use it: use gloo, "
                           "or torchrun, or start a process that touches no GPU before run_world")


class _PipeWriter(io.TextIOBase):
    """A rank's stdout/stderr: each write goes to the parent at once, so output survives a kill."""

    def __init__(self, conn):
        self._conn = conn
        self._left = MAX_OUTPUT_CHARS

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._left > 0 and text:
            piece = text[: self._left]
            self._left -= len(piece)
            if self._left <= 0:
                piece += "\n... (output cut)\n"
            self._conn.send_bytes(pickle.dumps(("out", piece)))
        return len(text)


def _die_with_parent() -> None:
    # A parent killed outright (SIGKILL, OOM) cannot clean up; the kernel then kills the ranks.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _join_store(conn, rank: int, world_size: int, timeout: timedelta):
    """The rendezvous store: rank 0 serves it on a port the OS picks at bind time (so no two
    worlds can collide on one) and tells the parent, which passes the port to the other ranks."""
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
        conn.send_bytes(pickle.dumps(("port", store.port)))
        return store
    if not conn.poll(timeout.total_seconds()):
        raise TimeoutError(f"rank 0 did not publish its store's port within {timeout.total_seconds():.0f} s")
    _, port = pickle.loads(conn.recv_bytes())
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)


def _all_joined(store, rank: int, world_size: int, timeout: timedelta) -> None:
    """Wait until every rank's process group is up. A rank whose ``fn`` needs no peer could
    otherwise finish and exit, taking the store it serves (rank 0) and its end of gloo's mesh with
    it, while a slower rank was still connecting: that rank's init failed with "Connection closed
    by peer" on a loaded machine. Through the store, so the group itself carries no extra message."""
    store.set(f"fastdl/joined/{rank}", "1")
    store.wait([f"fastdl/joined/{r}" for r in range(world_size)], timeout)


def _rank_main(fn, rank, world_size, args, kwargs, conn, backend, timeout_s, parent_pid) -> None:
    """Body of a forked rank. Never returns: os._exit skips the parent's atexit handlers and
    the destructors of objects (the kernel's sockets, say) that belong to the parent."""
    global _rank_device
    code = 0
    try:
        _die_with_parent()
        if os.getppid() != parent_pid:
            os._exit(1)
        # Ctrl-C and the notebook's interrupt reach the parent, which stops every rank.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sys.stdout = sys.stderr = _PipeWriter(conn)
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            _rank_device = torch.device("cuda", rank)
        else:
            _rank_device = torch.device("cpu")
        timeout = timedelta(seconds=timeout_s)
        store = _join_store(conn, rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        _all_joined(store, rank, world_size, timeout)
        payload = pickle.dumps(("ok", _to_cpu(fn(rank, world_size, *args, **kwargs))))
        conn.send_bytes(payload)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (a rank must report whatever stopped it)
        code = 1
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        try:
            conn.send_bytes(pickle.dumps(("error", reason, traceback.format_exc(), time.monotonic())))
        except Exception:  # noqa: BLE001  (the parent may be gone already)
            pass
    finally:
        os._exit(code)


def _peer_vanished(reason: str) -> bool:
    """Whether a rank's error only reports that another rank went away (gloo's wording)."""
    return "by peer" in reason or "remote worker" in reason


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode} without returning a result"


class _World:
    """The parent's view of the forked ranks: their processes, pipes and what each sent."""

    def __init__(self):
        self.procs, self.conns = [], []
        self.results: dict[int, object] = {}
        self.failures: list[tuple[float, int, str, str]] = []
        self._open: set[int] = set()
        self._partial_line: list[str] = []

    def add(self, proc, conn) -> None:
        self._open.add(len(self.procs))
        self.procs.append(proc)
        self.conns.append(conn)
        self._partial_line.append("")

    def _show(self, rank: int, text: str) -> None:
        lines = (self._partial_line[rank] + text).split("\n")
        self._partial_line[rank] = lines.pop()
        for line in lines:
            print(f"[rank {rank}] {line}")

    def drain(self, rank: int) -> None:
        """Read every message rank has sent so far."""
        conn = self.conns[rank]
        while rank in self._open and conn.poll():
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._open.discard(rank)
                break
            if message[0] == "out":
                self._show(rank, message[1])
            elif message[0] == "port":
                for other in self.conns[1:]:
                    other.send_bytes(pickle.dumps(message))
            elif message[0] == "ok":
                self.results[rank] = message[1]
            else:
                _, reason, trace, when = message
                self.failures.append((when, rank, reason, trace))

    def poll(self, timeout: float) -> None:
        """Wait up to ``timeout`` for any rank to speak or exit, then take in what happened."""
        waiting = [r for r in range(len(self.procs)) if r not in self.results]
        connection.wait([self.conns[r] for r in waiting if r in self._open]
                        + [self.procs[r].sentinel for r in waiting], timeout=timeout)
        for rank in waiting:
            self.drain(rank)
            if (rank not in self.results and self.procs[rank].exitcode is not None
                    and not any(f[1] == rank for f in self.failures)):
                self.failures.append((time.monotonic(), rank, _exit_reason(self.procs[rank].exitcode), ""))

    def blame(self) -> RankFailure:
        """The failure to report, with what became of every other rank.

        A rank's failure makes its peers fail too (a closed connection, a timeout): the first
        failure that is not a peer's vanishing is the cause. A death has no timestamp of its own
        (the parent notices it late), so time order alone would blame the rank that saw the dead
        one's connection close.
        """
        grace = time.monotonic() + 0.5
        while time.monotonic() < grace and len(self.failures) < len(self.procs) - len(self.results):
            self.poll(0.05)
        _, _, rank, reason, trace = min((_peer_vanished(f[2]), *f) for f in self.failures)
        others = []
        for other in range(len(self.procs)):
            own = [f[2] for f in self.failures if f[1] == other]
            if other in self.results:
                others.append(f"rank {other} had returned")
            elif other != rank:
                others.append(f"rank {other} failed too: {own[0].splitlines()[0][:200]}" if own else
                              f"rank {other} was still running when the world was stopped")
        self.flush_output()
        details = "\n".join(part for part in (others and f"({'; '.join(others)})", trace.rstrip()) if part)
        return RankFailure(rank, reason, details)

    def flush_output(self) -> None:
        for rank, rest in enumerate(self._partial_line):
            if rest:
                self._show(rank, "\n")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()


_compiler_stack_loaded = False
# Worlds started from several threads fork their ranks one thread at a time, after the compiler
# stack is loaded: a fork while another thread is halfway through an import copies the import
# locks it holds into the rank, and filelock (which torch.compile imports) refuses a fork while
# another thread is forking (RuntimeError "os.fork is unsafe while filelock is changing descriptor
# ownership", seen with Python 3.12).
_forking = threading.Lock()


def _load_compiler_stack_once() -> None:
    """Build and step one optimizer before the first fork: torch imports its compiler stack
    (torch._dynamo, about 1.5 s) on a process's first optimizer step, which every forked rank of
    every world would otherwise pay again."""
    global _compiler_stack_loaded
    if not _compiler_stack_loaded:
        param = torch.zeros(1, requires_grad=True)
        param.grad = torch.zeros(1)
        torch.optim.SGD([param], lr=0.0).step()
        _compiler_stack_loaded = True


def run_world(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 20.0, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; their results by rank.

    Ranks are forked processes on this machine, joined in a process group of ``backend``: gloo
    by default, on CPU tensors, even where there are GPUs (a notebook has usually initialised
    CUDA before, and forked children cannot use it then); ``backend="nccl"`` puts rank r on GPU r,
    from a process whose CUDA driver is untouched (set PYTORCH_NVML_BASED_CUDA_CHECK=1 before
    importing torch). Tensors in the results come back on the CPU. Every collective times out after ``timeout_s`` seconds and
    the whole call returns within ``2 * timeout_s + STARTUP_S``; any rank's exception, death or
    silence stops every rank and raises ``RankFailure``. ``fn`` should call
    ``rank_device()`` to know where its tensors go.

    Under torchrun (RANK and WORLD_SIZE set) it runs ``fn`` only for this process's rank, in the
    group torchrun describes (initialised once, with ``backend`` or NCCL when there is a GPU), and
    returns a list of ``world_size`` entries that is None except at this rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if _torchrun_env() is not None:
        return _run_under_torchrun(fn, world_size, args, kwargs, backend, timeout_s)
    import multiprocessing

    backend = backend or "gloo"
    if backend == "nccl":
        _check_nccl_fork(world_size)
    ctx = multiprocessing.get_context("fork")
    world = _World()
    try:
        with _forking:
            _load_compiler_stack_once()
            for rank in range(world_size):
                mine, theirs = ctx.Pipe()
                # Not daemonic: a daemonic process may not have children, and the grader's sandbox
                # may itself be one. Every rank is reaped below in any case.
                proc = ctx.Process(target=_rank_main, name=f"fastdl-rank-{rank}",
                                   args=(fn, rank, world_size, args, kwargs, theirs, backend, timeout_s, os.getpid()))
                # Flushed first, or the forked copy of an unflushed buffer would print twice.
                sys.stdout.flush()
                sys.stderr.flush()
                proc.start()
                theirs.close()
                world.add(proc, mine)
        limit = 2 * timeout_s + STARTUP_S
        deadline = time.monotonic() + limit
        while len(world.results) < world_size and not world.failures:
            if time.monotonic() >= deadline:
                silent = min(r for r in range(world_size) if r not in world.results)
                world.failures.append((time.monotonic(), silent, f"no result within {limit:.0f} s: deadlocked?", ""))
                break
            world.poll(deadline - time.monotonic())
        if world.failures:
            raise world.blame()
        world.flush_output()
        return [world.results[r] for r in range(world_size)]
    finally:
        world.stop()


def _check_rank(rank: int, world_size: int, fail: bool):
    if fail and rank == 1:
        raise ValueError("raised on purpose")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return total


def check() -> None:
    """A world of 2 returns both ranks' results; a rank that raises surfaces as RankFailure."""
    assert [t.item() for t in run_world(_check_rank, 2, False)] == [1.0, 1.0]
    try:
        run_world(_check_rank, 2, True)
    except RankFailure as failure:
        assert failure.rank == 1 and failure.reason == "ValueError: raised on purpose", failure
    else:
        raise AssertionError("a failing rank did not raise RankFailure")
    print("launch: worlds return every rank's result, and name the rank that failed")

