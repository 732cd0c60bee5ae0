"""The one line between a grading child and the grader: a Unix socket in the child's job folder.

The grader listens on ``SOCKET`` in the folder it made for the child (read-only to the child, at
``/job/in``) and accepts one connection, which the child's runner opens before any student code
exists. Over it, in frames of the data-only format (``autograder.wire``: an 8-byte length, then
the value), the child

- delivers its outputs once (``{"kind": "outputs", "value": ...}``) or says why it could not
  (``{"kind": "error", "status": ..., "error": ...}``);
- marks the timed phase of a kernel speed item (``{"kind": "mark", "phase": ...}``), which the
  grader stamps with its own clock on arrival;
- asks the grader's services for what must not live in its process (``{"kind": "call", ...}``):
  a device the grader simulates, a relay for collectives; each answered by one reply frame;
- answers the grader's calls (``{"kind": "result", ...}``) when the grader drives it call by call
  and times each on its own clock (``Endpoint.call``).

Nothing the child sends is believed for what it says, only taken as data the grader then checks:
the child's runner is untrusted from the moment student code is loaded. Every frame is capped
before its body is read (``MAX_FRAME``), so a child can make the grader hold at most one frame.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from autograder import wire

SOCKET = "grader.sock"
FRAME = struct.Struct("<Q")
# The largest frame a grader reads: the outputs of the largest item fit.
MAX_FRAME = 512 << 20
# Marks kept per child: a speed item's phase has two; more says the protocol was not followed.
MAX_MARKS = 16
# Error frames kept per child: the runner sends one. What a child sends beyond what the grader
# keeps is counted, never held: a child that repeats a large frame must not grow the grader.
MAX_ERRORS = 4
# Results of driven calls waiting to be taken (``Endpoint.call`` waits for one at a time); a child
# that sends more than this ahead floods the grader and its line is ended.
MAX_RESULTS_WAITING = 4
ERROR_CHARS = 2000
# How often the listening thread looks whether the grader has stopped waiting for the child.
ACCEPT_TICK_S = 0.05


class ChannelError(Exception):
    """The other side closed the line, sent a frame over its cap, or sent something unreadable."""


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelError("the other side closed the line")
        got += k
    return data


def _through_folder(action, path: str) -> None:
    """``action(address)`` for a Unix socket at ``path``, however long: an address holds at most 107
    bytes, and a job folder deep in a temporary directory is longer. Through the folder's
    descriptor (``/proc/self/fd/N/name``) the address is short, and names the same file."""
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        action(f"/proc/self/fd/{fd}/{name}")
    finally:
        os.close(fd)


def bind(sock: socket.socket, path: str) -> None:
    _through_folder(sock.bind, path)


def connect(sock: socket.socket, path: str) -> None:
    _through_folder(sock.connect, path)


def send(sock: socket.socket, value) -> None:
    data = wire.encode(value)
    sock.sendall(FRAME.pack(len(data)) + data)


def recv(sock: socket.socket, cap: int = MAX_FRAME):
    (n,) = FRAME.unpack(_recv_exact(sock, FRAME.size))
    if n > cap:
        raise ChannelError(f"a frame of {n} bytes, more than the {cap >> 20} MiB a frame may hold")
    try:
        return wire.decode(_recv_exact(sock, n))
    except wire.WireError as exc:
        raise ChannelError(f"a frame that is not data: {exc}") from None


# --- the child's side ------------------------------------------------------------------------

# The runner's link, once it has connected: a drive that asks the grader's services finds it here.
child_link: "Link | None" = None



class Link:
    """The child's end: opened by the runner before student code loads."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connect(self.sock, path)
        self._lock = threading.Lock()

    def send(self, kind: str, **fields) -> None:
        with self._lock:
            send(self.sock, {"kind": kind, **fields})

    def call(self, service: str, **args):
        """Ask one of the grader's services; its reply, or the error it answered with, raised."""
        with self._lock:
            send(self.sock, {"kind": "call", "service": service, "args": args})
            reply = recv(self.sock)
        if not isinstance(reply, dict) or reply.get("kind") != "reply":
            raise ChannelError("the grader answered out of turn")
        if "error" in reply:
            raise RuntimeError(str(reply["error"]))
        return reply.get("value")

    def next_request(self):
        """The grader's next call when the grader drives (``Endpoint.call``); None when it is done."""
        message = recv(self.sock)
        if not isinstance(message, dict) or message.get("kind") != "request":
            return None
        return message

    def close(self) -> None:
        self.sock.close()


# --- the grader's side -----------------------------------------------------------------------


@dataclass
class Received:
    """What the child sent, taken as data."""

    outputs: list = field(default_factory=list)  # the first outputs frame's value (one is the protocol)
    deliveries: int = 0  # how many outputs frames came: the later ones are counted, not kept
    errors: list[dict] = field(default_factory=list)
    marks: list[tuple[str, float]] = field(default_factory=list)  # (phase, the grader's clock on arrival)
    connected: bool = False
    problem: str = ""  # how the line broke the protocol, if it did
    calls: int = 0


class Endpoint:
    """The grader's end for one child: listens in ``folder``, accepts the first connection and
    reads its frames in a thread of the grading process. ``services`` answer the child's calls
    (``{name: handler(**args) -> value}``, run in the reading thread); ``call`` drives the child
    request by request."""

    def __init__(self, folder: str, services: dict[str, Callable[..., Any]] | None = None, *,
                 max_frame: int = MAX_FRAME):
        self.path = os.path.join(folder, SOCKET)
        self.services = services or {}
        self.max_frame = max_frame
        self.received = Received()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bind(self._listener, self.path)
        os.chmod(self.path, 0o666)  # the sandbox's uid connects; the folder around it is read-only to it
        self._listener.listen(1)
        self._conn: socket.socket | None = None
        self._results: queue.Queue = queue.Queue()
        self._connected = threading.Event()
        self._closing = threading.Event()
        self._calls = 0
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fastdl-channel")
        self._thread.start()

    def _accept(self) -> socket.socket | None:
        self._listener.settimeout(ACCEPT_TICK_S)
        try:
            while not self._closing.is_set():
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                conn.settimeout(None)
                return conn
            return None
        except OSError:
            return None
        finally:
            self._listener.close()  # one connection: a second one from student code finds nobody

    def _serve(self) -> None:
        conn = self._accept()
        if conn is None:
            self._results.put(None)
            return
        self._conn = conn
        self.received.connected = True
        self._connected.set()
        try:
            while True:
                self._handle(recv(conn, self.max_frame))
        except (ChannelError, OSError) as exc:
            if not isinstance(exc, ChannelError) or "closed the line" not in str(exc):
                self.received.problem = self.received.problem or str(exc)[:300]
        finally:
            self._results.put(None)

    def _handle(self, message) -> None:
        got = self.received
        kind = message.get("kind") if isinstance(message, dict) else None
        if kind == "outputs":
            got.deliveries += 1
            if not got.outputs:
                got.outputs.append(message.get("value"))
        elif kind == "error":
            if len(got.errors) < MAX_ERRORS:
                got.errors.append({"status": str(message.get("status", "error"))[:40],
                                   "error": str(message.get("error", ""))[:ERROR_CHARS]})
        elif kind == "mark":
            if len(got.marks) < MAX_MARKS:
                got.marks.append((str(message.get("phase", ""))[:40], time.monotonic()))
        elif kind == "call":
            got.calls += 1
            self._answer(message)
        elif kind == "result":
            if self._results.qsize() >= MAX_RESULTS_WAITING:
                raise ChannelError(f"more than {MAX_RESULTS_WAITING} results sent ahead of the grader's calls")
            self._results.put(message)
        else:
            got.problem = got.problem or f"a frame of unknown kind {str(kind)[:40]!r}"

    def _answer(self, message: dict) -> None:
        handler = self.services.get(message.get("service"))
        args = message.get("args")
        if handler is None or not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            reply = {"kind": "reply", "error": f"no service {str(message.get('service'))[:40]!r} with those arguments"}
        else:
            try:
                reply = {"kind": "reply", "value": handler(**args)}
            except Exception as exc:  # noqa: BLE001 - the child's request was wrong: tell it, keep serving
                reply = {"kind": "reply", "error": f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]}
        self._send(reply)

    def _send(self, value) -> None:
        with self._send_lock:
            send(self._conn, value)

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def call(self, name: str, timeout_s: float, **args):
        """Send the child a request and wait for its result: ``(value, seconds)`` where seconds run
        on the grader's clock from the request's send to the result's arrival; ``ChannelError``
        when the child does not answer within ``timeout_s``."""
        if self._conn is None:
            raise ChannelError("the child never connected")
        # A result sent before its request (or a second one for an earlier call) answers nothing:
        # each request carries a number its result must echo.
        self._calls += 1
        while True:
            try:
                stale = self._results.get_nowait()
            except queue.Empty:
                break
            if stale is None:
                self._results.put(None)
                break
        start = time.monotonic()
        deadline = start + timeout_s
        self._send({"kind": "request", "id": self._calls, "name": name, "args": args})
        while True:
            try:
                result = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ChannelError(f"no result within {timeout_s:.0f} s") from None
            if result is None or result.get("id") == self._calls:
                break
        seconds = time.monotonic() - start
        if result is None:
            raise ChannelError(self.received.problem or "the child closed the line")
        if "error" in result:
            raise ChannelError(f"the call raised {str(result['error'])[:ERROR_CHARS]}")
        return result.get("value"), seconds

    def finish(self) -> None:
        """Tell a driven child there is nothing more (it then delivers and exits)."""
        if self._conn is not None:
            try:
                self._send({"kind": "done"})
            except OSError:
                pass

    def close(self, timeout_s: float = 5.0) -> Received:
        """Stop listening; wait for the reader to drain what the ended child sent."""
        self._closing.set()
        self._thread.join(timeout_s)
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass
        return self.received
