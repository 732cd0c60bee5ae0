"""A rank's side of the relay: a torch.distributed backend whose only network is the relay's socket.

``init_relay_world(socket_path, rank, world_size, timeout_s)`` connects to the relay
(``relay.py``), waits until every rank of the world has connected, and makes the default process
group a ``RelayProcessGroup`` (backend ``"fastdl_relay"``). From then on the ordinary
``torch.distributed`` functions work unchanged, blocking or with ``async_op=True``, and so does
code written for them, torch's ``DistributedDataParallel`` included. The store that
``init_process_group`` requires is a ``HashStore`` of this process: nothing reaches another rank
but the relay.

Each call sends its request the moment it is made and returns a ``RelayWork`` at once; a thread
of this process reads the relay's answers, copies each into its call's outputs and completes the
work (``wait()``, ``get_future()``). So an all-reduce started from a gradient hook travels while
backward goes on, as it would over gloo. A send completes once the relay holds its bytes; its
tensor is copied when the call is made.

Carried: ``all_reduce`` (SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR; coalesced too, as one
collective), ``reduce``, ``broadcast``, ``all_gather``, ``all_gather_single``
(``all_gather_into_tensor``), ``reduce_scatter``, ``reduce_scatter_single``
(``reduce_scatter_tensor``), their coalesced forms (one collective per tensor: what torch's
functional collectives, DTensor and FSDP2 call), ``gather``, ``scatter``, ``barrier``,
``send``/``isend`` and ``recv``/``irecv`` with tags, from a given source or any. Not carried (each
raises, naming itself): all-to-all, ``monitored_barrier``, the list form of coalesced all-gather,
subgroups (``new_group``; a one-dimensional DeviceMesh over the whole world works), PREMUL_SUM,
dtypes the data format lacks (float8, unsigned wider than uint8). Tensors travel through this
process's memory, so a GPU tensor is copied to the CPU and back.

This module runs in the rank's process, next to student code: nothing it counts is believed.
The relay's log is the record.
"""

from __future__ import annotations

import itertools
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from autograder.engine import relay_protocol as protocol
from autograder.engine.relay_protocol import spec

BACKEND = "fastdl_relay"
# How long past the world's timeout a wait gives the relay to answer before it gives up on it:
# the relay fails a collective at the timeout and answers at once.
GRACE_S = 5.0

# The connection init_relay_world made, for the backend's creator to take (torch builds the
# process group through a registered function that takes no socket).
_joining: tuple[socket.socket, dict] | None = None


class RelayWork(dist._Work):
    """One request in flight: done when the relay's answer has been copied into its outputs."""

    def __init__(self, outputs: list[torch.Tensor], value, timeout_s: float):
        super().__init__()
        self._outputs = outputs
        self._value = value
        self._timeout_s = timeout_s
        self._future = torch.futures.Future()
        self._done = threading.Event()
        self._error: Exception | None = None
        self._src = -1

    def _complete(self, answer: dict) -> None:
        """Called by the reading thread with the relay's answer."""
        try:
            if "error" in answer:
                raise RuntimeError(f"relay: {answer['error']}")
            results = answer.get("tensors")
            if not isinstance(results, list) or len(results) != len(self._outputs):
                raise RuntimeError("relay: an answer with the wrong number of tensors")
            for out, got in zip(self._outputs, results):
                if got.dtype != out.dtype or got.numel() != out.numel():
                    raise RuntimeError(f"relay: answered {got.dtype} x {got.numel()} for {out.dtype} x {out.numel()}")
                with torch.no_grad():
                    out.copy_(got.reshape(out.shape))
            self._src = int(answer.get("src", -1))
        except Exception as exc:  # noqa: BLE001 - whatever went wrong is this work's failure
            self._finish(exc)
        else:
            self._finish(None)

    def _finish(self, error: Exception | None) -> None:
        self._error = error
        # The future first: DDP's reducer hangs its callbacks on it, and wait() returning means
        # they have run.
        if error is None:
            self._future.set_result(self._value)
        else:
            self._future.set_exception(error)
        self._done.set()

    @classmethod
    def joined(cls, works: list["RelayWork"], value, timeout_s: float) -> "RelayWork":
        """One work that is done when all of ``works`` are (a coalesced call made of single ones)."""
        whole = cls([], value, timeout_s)
        left, lock = [len(works)], threading.Lock()

        def one_done(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                whole._finish(next((w._error for w in works if w._error is not None), None))

        for work in works:
            work.get_future().add_done_callback(one_done)
        if not works:
            whole._finish(None)
        return whole

    def wait(self, timeout: timedelta | None = None) -> bool:
        # torch passes no timeout, or zero, for "the group's".
        seconds = timeout.total_seconds() if timeout else 0.0
        limit = seconds if seconds > 0 else self._timeout_s + GRACE_S
        if not self._done.wait(limit):
            raise RuntimeError(f"relay: no answer within {limit:g} s")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._value

    def synchronize(self) -> None:
        pass

    def _source_rank(self) -> int:
        return self._src

    def source_rank(self) -> int:
        return self._src


def _reduce_name(op) -> str:
    kind = op.op if hasattr(op, "op") else op
    name = kind.name.lower()
    if name not in protocol.REDUCE_OPS:
        raise ValueError(f"the relay does not reduce with {kind.name}")
    return name


class RelayProcessGroup(dist.ProcessGroup):
    """A process group whose every operation is a request to the relay (module docstring)."""

    def __init__(self, sock: socket.socket, welcome: dict, rank: int, world_size: int, timeout_s: float):
        super().__init__(rank, world_size)
        self._sock = sock
        self._timeout_s = timeout_s
        self._max_message = int(welcome["max_message_bytes"])
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, RelayWork] = {}
        self._broken: str | None = None
        self._group_name = self._group_desc = ""
        self._reader = threading.Thread(target=self._read, daemon=True, name="fastdl-relay-answers")
        self._reader.start()

    def getBackendName(self) -> str:
        return BACKEND

    # The base class keeps a group's name and description in its backends, and this group has
    # none: init_process_group names it, DeviceMesh (FSDP2) asks.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    # --- the line ---------------------------------------------------------------------------

    def _request(self, op: str, into: list[torch.Tensor], value, **fields) -> RelayWork:
        work = RelayWork(into, value, self._timeout_s)
        with self._send_lock:
            with self._lock:
                broken = self._broken
                request_id = next(self._ids)
                if broken is None:
                    self._pending[request_id] = work
            if broken is not None:
                work._complete({"error": broken})
                return work
            try:
                protocol.send(self._sock, {"id": request_id, "op": op, **fields}, cap=self._max_message)
            except ValueError:
                with self._lock:
                    self._pending.pop(request_id, None)
                raise
            except OSError as exc:
                self._break(f"the relay's socket failed ({exc.strerror or exc})")
        return work

    def _read(self) -> None:
        # The relay answers a gather with every rank's input: up to world_size requests' worth.
        cap = (self.size() + 1) * self._max_message
        try:
            while True:
                answer = protocol.recv(self._sock, cap)
                request_id = answer.get("id") if isinstance(answer, dict) else None
                with self._lock:
                    work = self._pending.pop(request_id, None)
                if work is not None:
                    work._complete(answer)
        except (protocol.ProtocolError, OSError) as exc:
            self._break(f"the relay closed the connection ({exc})")

    def _break(self, why: str) -> None:
        with self._lock:
            self._broken = self._broken or why
            pending, self._pending = self._pending, {}
        for work in pending.values():
            work._complete({"error": why})

    def shutdown(self) -> None:
        with self._lock:
            self._broken = self._broken or "the process group was shut down"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def abort(self) -> None:
        self.shutdown()

    # --- collectives (the names torch.distributed's functions and torch's C++ call) -----------

    def allreduce(self, tensors, opts=None):
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        return self._request("all_reduce", list(tensors), list(tensors), tensors=list(tensors), reduce=op)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        root = opts.rootRank
        outputs = list(tensors) if self.rank() == root else []
        return self._request("reduce", outputs, list(tensors), tensors=list(tensors),
                             reduce=_reduce_name(opts.reduceOp), root=root)

    def broadcast(self, tensors, opts):
        root, mine = opts.rootRank, self.rank() == opts.rootRank
        return self._request("broadcast", [] if mine else list(tensors), list(tensors),
                             tensors=list(tensors) if mine else [], specs=[spec(t) for t in tensors], root=root)

    def allgather(self, output_tensors, input_tensors, opts=None):
        outputs, tensor = list(output_tensors[0]), input_tensors[0]
        return self._request("all_gather", outputs, output_tensors, tensors=[tensor],
                             outputs=[spec(t) for t in outputs])

    def all_gather_single(self, output, input, opts=None):
        return self._request("all_gather_single", [output], [output], tensors=[input], output=spec(output))

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        output = output_tensors[0]
        return self._request("reduce_scatter", [output], output_tensors, tensors=list(input_tensors[0]),
                             output=spec(output), reduce=op)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _reduce_name(opts.reduceOp) if opts is not None else "sum"
        return self._request("reduce_scatter_single", [output], [output], tensors=[input], output=spec(output),
                             reduce=op)

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_tensors, input_tensors, opts):
        outputs = list(output_tensors[0]) if output_tensors else []
        return self._request("gather", outputs, output_tensors, tensors=[input_tensors[0]], root=opts.rootRank,
                             outputs=[spec(t) for t in outputs])

    def scatter(self, output_tensors, input_tensors, opts):
        output = output_tensors[0]
        pieces = list(input_tensors[0]) if input_tensors else []
        return self._request("scatter", [output], output_tensors, tensors=pieces, output=spec(output),
                             root=opts.rootRank)

    # What torch's functional collectives (DTensor.full_tensor, FSDP2) and the coalescing manager
    # call: one request per tensor, one work for them all.
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return RelayWork.joined(works, list(outputs), self._timeout_s)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return RelayWork.joined(works, list(outputs), self._timeout_s)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def barrier(self, opts=None):
        return self._request("barrier", [], [])

    # --- point to point -------------------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        return self._request("send", [], list(tensors), tensors=[tensors[0]], dst=int(dst), tag=int(tag))

    def recv(self, tensors, src, tag=0):
        return self._request("recv", [tensors[0]], list(tensors), output=spec(tensors[0]), src=int(src), tag=int(tag))

    def recv_anysource(self, tensors, tag=0):
        return self._request("recv", [tensors[0]], list(tensors), output=spec(tensors[0]), src=None, tag=int(tag))

    # --- what the relay does not carry ------------------------------------------------------------

    def _not_carried(name: str):
        def refuse(self, *args, **kwargs):
            raise NotImplementedError(f"{name} is not carried by the grader's relay")
        return refuse

    alltoall = _not_carried("alltoall")
    alltoall_base = all_to_all_single = _not_carried("all_to_all_single")
    monitored_barrier = _not_carried("monitored_barrier")
    allgather_coalesced = _not_carried("allgather_coalesced")
    del _not_carried


def mark(label: str, group: RelayProcessGroup | None = None) -> RelayWork:
    """Log ``label`` in the relay's record at the relay's clock, without waiting for it: where
    this rank's program says it is. Self-reported: code in the rank could send any label."""
    group = group if group is not None else dist.group.WORLD
    if not isinstance(group, RelayProcessGroup):
        raise TypeError("marks go to the relay: join with init_relay_world first")
    return group._request("mark", [], [], label=str(label)[:protocol.MARK_CHARS])


def _create(store, rank: int, world_size: int, timeout: timedelta) -> RelayProcessGroup:
    global _joining
    if _joining is None:
        raise RuntimeError(f"the {BACKEND} backend carries one world, joined with init_relay_world(); "
                           "new_group and subgroups are not carried")
    sock, welcome = _joining
    _joining = None
    return RelayProcessGroup(sock, welcome, rank, world_size, timeout.total_seconds())


def register() -> None:
    """Make ``"fastdl_relay"`` a backend name ``init_process_group`` knows (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def init_relay_world(socket_path: str, rank: int, world_size: int, timeout_s: float) -> RelayProcessGroup:
    """Join the world behind the relay listening on ``socket_path`` as the default process group.

    Returns once every rank has connected; raises when the relay says the world failed, or when
    ``rank``/``world_size`` are not what the relay knows this socket as."""
    global _joining
    register()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(socket_path)
        sock.settimeout(timeout_s + GRACE_S)
        try:
            hello = protocol.recv(sock, 1 << 16)
        except socket.timeout:
            raise RuntimeError(f"relay: the world was not complete within {timeout_s + GRACE_S:g} s") from None
        sock.settimeout(None)
        if not isinstance(hello, dict) or "welcome" not in hello:
            raise RuntimeError(f"relay: {hello.get('error') if isinstance(hello, dict) else 'no welcome'}")
        welcome = hello["welcome"]
        if (welcome.get("rank"), welcome.get("world_size")) != (rank, world_size):
            raise ValueError(f"this socket is rank {welcome.get('rank')} of {welcome.get('world_size')} "
                             f"to the relay, not rank {rank} of {world_size}")
    except BaseException:
        sock.close()
        raise
    _joining = (sock, welcome)
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    finally:
        _joining = None
    return dist.group.WORLD
