"""The network of a world of ranks: a relay in the grading process that performs every collective.

**What it guarantees.** Each rank of a graded world runs in a sandbox of its own (its own mount
and network namespaces, nothing shared), and the only way out of it is one Unix socket, bound
into that sandbox alone, to this relay. So the socket a message arrives on *is* the rank: a rank
never says which one it is. The relay takes every rank's part of a collective, checks that the
parts belong together (same operation, dtypes, shapes and roots in the same place of every
rank's sequence), computes the result itself with torch on CPU tensors and hands each rank its
share. Point-to-point messages pass through it too. Every collective and every message is
logged here (``records``), in the grading process, where no rank can write: which ranks, the
operation, dtype, shape, elements, the bytes each rank handed over and was handed back,
root/source/destination, tag, sequence number, and this process's monotonic clock when each rank
arrived and when the operation completed. A ring all-reduce's traffic, a DDP wrapper's
all-reduce count, sizes and order, FSDP's gathers: all of them are read from this log. A rank
may also log a *mark* (``relay_backend.mark``), a label stamped with the relay's clock on
arrival: where the rank's own program says it is (a step's backward, say), self-reported.

A world fails as a whole, and nothing waits past ``timeout_s``: parts that do not match, a
rank that disconnects while another waits for it (or with a request of its own unanswered), a
collective or receive not completed within ``timeout_s`` of its first arrival, a rank that
does not connect within ``timeout_s`` of the first, a message over ``max_message_bytes`` (refused
before its body is read), more than ``max_held_bytes`` handed over and not yet delivered, more
than ``max_operations`` logged or waiting, or answers a rank does not read. Every waiting rank
is then answered with the same error, and so is every later request.

**Sends are buffered.** A send completes as soon as the relay holds its bytes, whether or not
the receive is posted (gloo does the same for small messages; here for every size, up to
``max_held_bytes`` in flight across the world). So a ring whose ranks all send before they
receive works, as it does on gloo; code that relies on a send *waiting* for its receiver does
not exist in the labs. Messages between a pair of ranks with one tag arrive in order; a receive
from any source takes the earliest that arrived.

**What it does not guarantee.** The sandboxes are what make the socket the only way between
ranks; the relay cannot see a path that a world's setup leaves open (a shared folder, a shared
network namespace). It counts what ranks hand over, not what a rank computes before: a rank may
all-reduce a wrong tensor, which only the values it returns reveal. Timing is the relay's
clock at arrival and completion, which includes the rank's own scheduling. Reductions run in
rank order, so floating-point sums can differ from gloo's in the last bits (exact for
integer-valued data). Requests are decoded in the grading process, each bounded by
``max_message_bytes``, all held data by ``max_held_bytes`` and the log's length by
``max_operations``; the caller sizes them.
"""

from __future__ import annotations

import copy
import os
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from autograder.engine import channel
from autograder.engine import relay_ops as ops
from autograder.engine import relay_protocol as protocol
from autograder.engine.relay_ops import Mismatch, Refused, Request
from autograder.engine.relay_protocol import shown, spec, spec_numel

# How often the watchdog looks for timeouts, at most (a tenth of the timeout when that is less).
TICK_S = 0.05
ERROR_CHARS = 2000


@dataclass
class _Slot:
    """One collective: the parts of the ranks that have arrived at this place of their sequence."""

    seq: int
    signature: tuple
    described: str
    first_rank: int
    first_arrival: float
    record: dict
    requests: dict = field(default_factory=dict)


@dataclass
class _Mail:
    """A send the relay holds until its receive is posted."""

    src: int
    tag: int
    tensor: torch.Tensor
    record: dict


@dataclass
class _Posted:
    """A receive waiting for its send."""

    rank: int
    id: int
    src: int | None
    tag: int
    output: list
    arrived: float


class _Rank:
    def __init__(self, rank: int, path: str, listener: socket.socket):
        self.rank, self.path, self.listener = rank, path, listener
        self.conn: socket.socket | None = None
        self.connected = self.left = False
        self.collectives = 0  # the next collective's place in this rank's sequence
        self.messages_to: dict[int, int] = {}  # messages sent so far to each destination
        self.marks = 0
        self.waiting: dict[int, str] = {}  # requests not answered yet: id -> what they are
        self.outbox: deque = deque()
        self.outbox_bytes = 0
        self.threads: list[threading.Thread] = []


def bytes_sent(records: list[dict], rank: int, ops=("send",)) -> int:
    """Bytes ``rank`` handed the relay in the logged operations named in ``ops`` (its sends, by default)."""
    return sum(r["sent_bytes"].get(rank, 0) for r in records if r["op"] in ops)


class Relay:
    """Listens on one Unix socket per rank (``socket_paths[r]`` is rank r's) and carries the
    world's collectives in threads of this process. Bind the paths into the ranks' sandboxes,
    ``start()``, start the ranks (each calls ``relay_backend.init_relay_world``), then read
    ``records()`` and ``failure``; ``close()`` (or a ``with`` block) ends it.

    ``socket_mode``: the sockets' permissions; a rank running under another uid needs 0o666,
    with the folder around the socket closed to everyone else."""

    def __init__(self, socket_paths: list[str], *, timeout_s: float, max_message_bytes: int,
                 max_held_bytes: int | None = None, max_operations: int = 100_000, socket_mode: int = 0o600):
        if not socket_paths:
            raise ValueError("a world has at least one rank")
        self.timeout_s = float(timeout_s)
        self.max_message_bytes = int(max_message_bytes)
        self.max_held_bytes = int(max_held_bytes if max_held_bytes is not None else 8 * max_message_bytes)
        self.max_operations = int(max_operations)
        self.world_size = len(socket_paths)
        # Answers waiting for a rank: what is held, plus a gather's answer of every rank's message.
        self._max_outbox = self.max_held_bytes + self.world_size * self.max_message_bytes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closing = False
        self._failure: str | None = None
        self._records: list[dict] = []
        self._slots: dict[int, _Slot] = {}
        self._mailbox: dict[int, list[_Mail]] = {r: [] for r in range(self.world_size)}
        self._posted: list[_Posted] = []
        self._held = 0
        self._first_connect: float | None = None
        self._welcomed = False
        self._ranks: list[_Rank] = []
        self._watchdog: threading.Thread | None = None
        try:
            for rank, path in enumerate(socket_paths):
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._ranks.append(_Rank(rank, path, listener))
                # Through the folder's descriptor: a rank's folder deep in a scratch directory has a
                # path longer than a socket address holds.
                channel.bind(listener, path)
                os.chmod(path, socket_mode)
                listener.listen(1)
        except BaseException:
            self._close_sockets()
            raise

    # --- the caller's side --------------------------------------------------------------------

    def start(self) -> "Relay":
        for r in self._ranks:
            for target, name in ((self._serve, "reader"), (self._write, "writer")):
                thread = threading.Thread(target=target, args=(r,), daemon=True, name=f"fastdl-relay-{name}-{r.rank}")
                r.threads.append(thread)
                thread.start()
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="fastdl-relay-watchdog")
        self._watchdog.start()
        return self

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def failure(self) -> str | None:
        """Why the world failed, or None."""
        with self._lock:
            return self._failure

    def records(self) -> list[dict]:
        """The log so far, a copy: one record per collective, point-to-point message and mark, in
        order of first arrival. Fields: ``kind`` ("collective", "p2p" or "mark"), ``op``, ``seq``
        (a collective's place in every rank's sequence; a message's index on its
        source-destination link; a mark's index among its rank's), ``label`` (marks only),
        ``ranks``, ``src`` and ``dst`` (root, source, destination, or None), ``tag``, ``reduce``,
        ``dtype``, ``shape`` and ``numel`` (of what each rank contributes; for several tensors the
        first one's shape and the elements of all), ``sent_bytes`` and ``received_bytes`` ({rank:
        bytes} handed to and by the relay), ``arrived_s`` ({rank: clock}), ``completed_s`` (None
        until done) and ``error`` (the world's failure, on every record it left incomplete)."""
        with self._lock:
            return copy.deepcopy(self._records)

    def wait_ended(self, timeout_s: float) -> bool:
        """Wait until every rank that connected has disconnected, and either all connected or the
        world failed; whether that happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not self._ended():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True

    def abort(self, why: str) -> None:
        """Fail the world now (the grader saw a rank's sandbox end): every rank waiting, and every
        later request, is answered ``why``; no rank waits out the timeout for one that is gone."""
        with self._changed:
            self._fail(why)

    def close(self) -> None:
        """Stop serving: close every socket and remove the paths this relay bound."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._close_sockets()
        for r in self._ranks:
            for thread in r.threads:
                thread.join(2.0)
        if self._watchdog is not None:
            self._watchdog.join(2.0)

    def _close_sockets(self) -> None:
        for r in self._ranks:
            for sock in (r.conn, r.listener):
                if sock is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            try:
                if os.path.exists(r.path) and not os.path.isdir(r.path):
                    os.unlink(r.path)
            except OSError:
                pass

    def _ended(self) -> bool:
        connected = [r for r in self._ranks if r.connected]
        return all(r.left for r in connected) and (len(connected) == self.world_size or self._failure is not None)

    # --- threads ------------------------------------------------------------------------------

    def _accept(self, r: _Rank) -> socket.socket | None:
        r.listener.settimeout(TICK_S)
        try:
            while not self._closing:
                try:
                    conn, _ = r.listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                return conn
        except OSError:
            pass
        finally:
            # One connection per socket: a second process in the rank's sandbox finds nobody.
            r.listener.close()
        return None

    def _serve(self, r: _Rank) -> None:
        conn = self._accept(r)
        if conn is None:
            return
        with self._changed:
            r.conn, r.connected = conn, True
            now = time.monotonic()
            self._first_connect = self._first_connect or now
            if self._failure is not None:
                self._answer(r, {"error": self._failure})
            elif all(q.connected for q in self._ranks):
                self._welcome()
            self._changed.notify_all()
        why, broke_protocol = "closed its socket", False
        try:
            while True:
                message = protocol.recv(conn, self.max_message_bytes)
                with self._changed:
                    self._handle(r, message, time.monotonic())
        except protocol.ProtocolError as exc:
            if "closed the socket" not in str(exc):
                why, broke_protocol = str(exc), True
        except OSError as exc:
            why = f"its socket failed ({exc.strerror or exc})"
        with self._changed:
            if broke_protocol:
                # Nothing more is read from a rank that sent what the relay refuses.
                self._fail(f"rank {r.rank} sent {why}")
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._leave(r, why)
            self._changed.notify_all()

    def _write(self, r: _Rank) -> None:
        """Send r's answers in order. Never under the world's lock: a rank that stops reading
        stalls only this thread, and fails the world after ``timeout_s``."""
        poller = select.poll()
        registered = False
        while True:
            with self._changed:
                while not r.outbox and not self._closing:
                    self._changed.wait()
                if self._closing:
                    return
                value, nbytes = r.outbox.popleft()
                conn = r.conn
            try:
                frame = memoryview(protocol.encode(value))
                if not registered:
                    poller.register(conn, select.POLLOUT)
                    registered = True
                deadline = time.monotonic() + self.timeout_s
                while frame:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    if not poller.poll(left * 1000):
                        continue
                    try:
                        frame = frame[conn.send(frame, socket.MSG_DONTWAIT):]
                    except BlockingIOError:
                        continue
            except TimeoutError:
                with self._changed:
                    self._fail(f"rank {r.rank} did not read the relay's answers for {self.timeout_s:g} s")
                return
            except (OSError, ValueError):
                return  # the rank has gone; its reader notices
            finally:
                with self._lock:
                    r.outbox_bytes -= nbytes

    def _watch(self) -> None:
        tick = min(TICK_S, self.timeout_s / 10)
        with self._changed:
            while not self._closing:
                self._changed.wait(tick)
                if self._failure is None:
                    self._check_timeouts(time.monotonic())

    # --- the world's state (every method below runs under the lock) ------------------------------

    def _answer(self, r: _Rank, value: dict) -> None:
        if not r.connected or r.left:
            return
        nbytes = sum(t.numel() * t.element_size() for t in value.get("tensors", ()))
        r.outbox.append((value, nbytes))
        r.outbox_bytes += nbytes
        self._changed.notify_all()
        if r.outbox_bytes > self._max_outbox and self._failure is None:
            self._fail(f"rank {r.rank} does not read the relay's answers ({r.outbox_bytes} bytes wait for it; "
                       f"at most {self._max_outbox})")

    def _reply(self, rank: int, request_id: int, tensors: list, **extra) -> int:
        r = self._ranks[rank]
        r.waiting.pop(request_id, None)
        self._answer(r, {"id": request_id, "tensors": tensors, **extra})
        return sum(t.numel() * t.element_size() for t in tensors)

    def _welcome(self) -> None:
        self._welcomed = True
        for r in self._ranks:
            self._answer(r, {"welcome": {"rank": r.rank, "world_size": self.world_size,
                                         "max_message_bytes": self.max_message_bytes, "timeout_s": self.timeout_s}})

    def _fail(self, why: str) -> None:
        """Fail the world: every waiting request, and every later one, is answered ``why``."""
        if self._failure is not None:
            return
        why = why[:ERROR_CHARS]
        self._failure = why
        for r in self._ranks:
            if r.connected and not self._welcomed:
                self._answer(r, {"error": why})
            for request_id in list(r.waiting):
                r.waiting.pop(request_id)
                self._answer(r, {"id": request_id, "error": why})
        for record in self._records:
            if record["completed_s"] is None:
                record["error"] = why
        for mails in self._mailbox.values():
            mails.clear()
        self._slots.clear()
        self._posted.clear()
        self._held = 0
        self._changed.notify_all()

    def _count_operation(self) -> None:
        # Every record and every receive waiting costs the grading process memory, empty or not.
        if len(self._records) + len(self._posted) >= self.max_operations:
            raise Refused(f"more than {self.max_operations} operations in one world")

    def _log(self, record: dict) -> None:
        self._count_operation()
        self._records.append(record)

    def _hold(self, nbytes: int) -> None:
        self._held += nbytes
        if self._held > self.max_held_bytes:
            raise Refused(f"the ranks have handed the relay {self._held} bytes not yet delivered; at most "
                          f"{self.max_held_bytes} may be in flight")

    def _handle(self, r: _Rank, message, arrived: float) -> None:
        request_id = message.get("id") if isinstance(message, dict) else None
        if type(request_id) is not int:
            self._fail(f"rank {r.rank} sent a message the relay does not understand (no request id)")
            return
        if self._failure is not None:
            self._answer(r, {"id": request_id, "error": self._failure})
            return
        # Waiting from now on: a request the relay refuses is answered with the world's failure.
        r.waiting[request_id] = "request"
        try:
            request = ops.parse(r.rank, request_id, message, arrived)
            r.waiting[request_id] = request.op
            if request.op == "mark":
                r.marks += 1
                self._log(ops.mark_record(request, r.marks - 1))
                self._reply(r.rank, request_id, [])
            elif request.op == "send":
                self._send(request)
            elif request.op == "recv":
                self._recv(request)
            else:
                self._collective(r, request)
        except Refused as exc:
            self._fail(f"rank {r.rank}: {exc}")
        except Mismatch as exc:
            self._fail(str(exc))
        except Exception as exc:  # noqa: BLE001 - torch refused what the checks let through: fail, never hang
            self._fail(f"the relay could not carry rank {r.rank}'s {r.waiting.get(request_id, 'request')}: "
                       f"{type(exc).__name__}: {exc}")

    def _leave(self, r: _Rank, why: str) -> None:
        r.left = True
        if self._failure is not None:
            return
        if r.waiting:
            what = ", ".join(sorted(set(r.waiting.values())))
            self._fail(f"rank {r.rank} disconnected ({why}) with its {what} unanswered")
            return
        for slot in self._slots.values():
            if r.rank not in slot.requests:
                self._fail(f"rank {r.rank} disconnected ({why}) while ranks {sorted(slot.requests)} waited for it "
                           f"in collective #{slot.seq}, {slot.described}")
                return
        for posted in self._posted:
            if self._unreachable(posted):
                self._fail(f"rank {r.rank} disconnected ({why}) while rank {posted.rank} waited for a message from it")
                return

    def _unreachable(self, posted: _Posted) -> bool:
        """Whether no rank that could still send ``posted`` its message is connected."""
        senders = [posted.src] if posted.src is not None else [q for q in range(self.world_size) if q != posted.rank]
        return all(self._ranks[q].left for q in senders)

    def _check_timeouts(self, now: float) -> None:
        limit = self.timeout_s
        if not self._welcomed and self._first_connect is not None and now - self._first_connect > limit:
            missing = [r.rank for r in self._ranks if not r.connected]
            self._fail(f"ranks {missing} did not connect within {limit:g} s of the first")
            return
        for slot in self._slots.values():
            if now - slot.first_arrival > limit:
                absent = [q for q in range(self.world_size) if q not in slot.requests]
                self._fail(f"collective #{slot.seq}, {slot.described}, timed out after {limit:g} s: ranks "
                           f"{sorted(slot.requests)} arrived, ranks {absent} did not")
                return
        for posted in self._posted:
            if now - posted.arrived > limit:
                source = f"rank {posted.src}" if posted.src is not None else "any rank"
                self._fail(f"rank {posted.rank}'s recv of {shown(posted.output)} from {source} (tag {posted.tag}) "
                           f"timed out after {limit:g} s: no matching send")
                return

    # --- point to point -----------------------------------------------------------------------

    def _send(self, req: Request) -> None:
        dst = ops.rank_field(req.fields, "dst", self.world_size)
        tag = req.fields.get("tag", 0)
        if dst == req.rank:
            raise Refused("send to itself")
        if len(req.tensors) != 1:
            raise Refused("a send carries one tensor")
        sender = self._ranks[req.rank]
        seq = sender.messages_to.get(dst, 0)
        sender.messages_to[dst] = seq + 1
        record = ops.message_record(req, seq, dst, tag)
        self._log(record)
        mail = _Mail(req.rank, tag, req.tensors[0], record)
        posted = next((p for p in self._posted if p.rank == dst and p.tag == tag and p.src in (None, req.rank)), None)
        if posted is not None:
            self._posted.remove(posted)
            self._deliver(mail, posted)
        else:
            self._hold(req.nbytes)
            self._mailbox[dst].append(mail)
        self._reply(req.rank, req.id, [])  # buffered: the send is done once the relay holds it

    def _recv(self, req: Request) -> None:
        src = ops.rank_field(req.fields, "src", self.world_size, optional=True)
        tag = req.fields.get("tag", 0)
        if src == req.rank:
            raise Refused("recv from itself")
        if "output" not in req.fields:
            raise Refused("a recv declares its output")
        posted = _Posted(req.rank, req.id, src, tag, req.fields["output"], req.arrived)
        mails = self._mailbox[req.rank]
        for mail in mails:
            if mail.tag == tag and src in (None, mail.src):
                mails.remove(mail)
                self._held -= mail.tensor.numel() * mail.tensor.element_size()
                self._deliver(mail, posted)
                return
        if self._unreachable(posted):
            source = f"rank {src}, which has" if src is not None else "every other rank, which have"
            self._fail(f"rank {req.rank}'s recv waits for {source} left the world")
            return
        self._count_operation()
        self._posted.append(posted)

    def _deliver(self, mail: _Mail, posted: _Posted) -> None:
        got = spec(mail.tensor)
        if got[0] != posted.output[0] or mail.tensor.numel() != spec_numel(posted.output):
            raise Mismatch(f"rank {posted.rank}'s recv into {shown(posted.output)} matched rank {mail.src}'s send "
                           f"of {shown(got)} (tag {mail.tag})")
        received = self._reply(posted.rank, posted.id, [mail.tensor], src=mail.src)
        record = mail.record
        record["received_bytes"][posted.rank] = received
        record["arrived_s"][posted.rank] = posted.arrived
        record["completed_s"] = time.monotonic()

    # --- collectives --------------------------------------------------------------------------

    def _collective(self, r: _Rank, req: Request) -> None:
        seq = r.collectives
        r.collectives += 1
        signature, described, root, contributed = ops.signature(req, self.world_size)
        slot = self._slots.get(seq)
        if slot is None:
            record = ops.record(req, seq, self.world_size, root, contributed)
            self._log(record)
            slot = self._slots[seq] = _Slot(seq, signature, described, req.rank, req.arrived, record)
        elif signature != slot.signature:
            raise Mismatch(f"collective #{seq} does not match across ranks: rank {slot.first_rank} called "
                           f"{slot.described}, rank {req.rank} called {described}")
        slot.requests[req.rank] = req
        slot.record["sent_bytes"][req.rank] = req.nbytes
        slot.record["arrived_s"][req.rank] = req.arrived
        self._hold(req.nbytes)
        gone = [q for q in range(self.world_size) if self._ranks[q].left and q not in slot.requests]
        if gone:
            self._fail(f"collective #{seq}, {described}, needs ranks {gone}, which have left the world")
            return
        if len(slot.requests) == self.world_size:
            results = ops.compute(req.op, [slot.requests[q] for q in range(self.world_size)])
            del self._slots[seq]
            self._held -= sum(q.nbytes for q in slot.requests.values())
            for rank, q in slot.requests.items():
                slot.record["received_bytes"][rank] = self._reply(rank, q.id, results.get(rank, []))
            slot.record["completed_s"] = time.monotonic()

