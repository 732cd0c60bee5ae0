"""Lab 00's asynchronous device, kept where the student's code cannot reach it.

In the notebook, ``fastdl_lab.measure.SimulatedAsyncDevice`` lives in the student's process: a
worker thread that sleeps for each launched op. Graded that way, the device, its counters and the
clock that proves a loop waited would all be the student's to rewrite. So for grading the device
is split across the boundary:

- ``DeviceService`` runs in the grader (an ``Item.services`` object). It keeps the device's queue
  on the grader's own clock: a launch returns at once and queues ``op_seconds`` of work (the
  first one ``compile_seconds`` more), a synchronize answers only once the queued work is done.
  It records every call with the grader's time of arrival and of answer; that record, not what
  the child reports, is what the item's verdict rests on.
- ``RemoteDevice`` runs in the child: the same methods and attributes as ``SimulatedAsyncDevice``,
  each a call over the child's channel to the grader's service. It is untrusted like everything
  in the child; replacing it only changes what the grader's record shows.
"""

from __future__ import annotations

import threading
import time
from collections import deque

SERVICE = "device"
# A timing loop makes a few dozen calls. The caps bound what one child can make the grader keep
# (the record) and wait for (a synchronize sleeps in the thread that reads the child's channel).
MAX_CALLS = 4096
MAX_LAUNCHES = 64


class DeviceService:
    """The grader's simulated device for one child: its queue on the grader's clock, and its record."""

    def __init__(self, op_seconds: float, compile_seconds: float, clock=time.monotonic):
        self.op_seconds = float(op_seconds)
        self.compile_seconds = float(compile_seconds)
        self._clock = clock
        self._origin = clock()
        self._busy_until = self._origin  # when the last queued op finishes
        self._ends: list[float] = []  # when each launched op finishes
        self._events: list[list] = []  # [call, arrived_s, answered_s], seconds from the service's start
        self._refused = 0
        self._closed = False
        self._recorded = threading.Event()  # the grader took the record: stop waiting for anything
        self._lock = threading.Lock()

    # --- the child's calls ---------------------------------------------------------------------

    def handle(self, call: str = "", **args):
        arrived = self._clock()
        method = self._CALLS.get(call)
        if method is None or args:
            raise ValueError(f"the device has no call {str(call)[:40]!r} with those arguments")
        with self._lock:
            if len(self._events) >= MAX_CALLS:
                self._refused += 1
                raise RuntimeError(f"the device answers at most {MAX_CALLS} calls")
        value = method(self, arrived)
        with self._lock:
            self._events.append([call, arrived - self._origin, self._clock() - self._origin])
        return value

    def _info(self, arrived: float) -> dict:
        return {"op_seconds": self.op_seconds, "compile_seconds": self.compile_seconds}

    def _launch(self, arrived: float) -> int:
        if self._closed:
            raise RuntimeError("device is closed")
        if len(self._ends) >= MAX_LAUNCHES:
            raise RuntimeError(f"the device takes at most {MAX_LAUNCHES} launches")
        seconds = self.op_seconds + (0.0 if self._ends else self.compile_seconds)
        self._busy_until = max(arrived, self._busy_until) + seconds
        self._ends.append(self._busy_until)
        return len(self._ends)

    def _drain(self) -> None:
        """Answer only once every queued op has run, on the grader's clock."""
        while not self._recorded.is_set() and (left := self._busy_until - self._clock()) > 0:
            self._recorded.wait(left)

    def _completed(self) -> int:
        now = self._clock()
        return sum(1 for end in self._ends if end <= now)

    def _synchronize(self, arrived: float) -> int:
        self._drain()
        return self._completed()

    def _state(self, arrived: float) -> dict:
        return {"launched": len(self._ends), "completed": self._completed()}

    def _close(self, arrived: float) -> None:
        self._drain()
        self._closed = True

    _CALLS = {"info": _info, "launch": _launch, "synchronize": _synchronize, "result": _synchronize,
              "state": _state, "close": _close}

    # --- the grader's side ---------------------------------------------------------------------

    def record(self) -> dict:
        """Every call the child made, timed on the grader's clock; ends any wait still pending."""
        self._recorded.set()
        with self._lock:
            return {"op_seconds": self.op_seconds, "compile_seconds": self.compile_seconds,
                    "events": [list(e) for e in self._events],
                    "op_ends": [end - self._origin for end in self._ends], "refused": self._refused}


class RemoteDevice:
    """``SimulatedAsyncDevice``'s API in the grading child, served by the grader's ``DeviceService``.

    An op passed to ``launch`` is a Python callable, which cannot cross to the grader: it runs here,
    in launch order, once a synchronize has seen the device finish it; its value is what ``result``
    returns and its error is raised by that synchronize, as on the in-process device.
    """

    def __init__(self, link=None, service: str = SERVICE):
        if link is None:
            from autograder.engine import channel

            link = channel.child_link
        self._link, self._service = link, service
        info = self._call("info")
        self.op_seconds = info["op_seconds"]
        self.compile_seconds = info["compile_seconds"]
        self._ops: deque = deque()
        self._ran = 0
        self._value = None
        self._error: BaseException | None = None
        self._closed = False

    def _call(self, call: str):
        return self._link.call(self._service, call=call)

    def launch(self, op=None) -> None:
        """Enqueue one op; returns at once."""
        if self._closed:
            raise RuntimeError("device is closed")
        self._call("launch")
        self._ops.append(op)

    def _run_finished_ops(self) -> None:
        while self._ops:
            op = self._ops.popleft()
            try:
                self._value = op() if op is not None else self._ran + 1
            except BaseException as exc:  # noqa: BLE001  (re-raised at the synchronize, as on a GPU)
                self._error = exc
            self._ran += 1

    @property
    def launched(self) -> int:
        return self._call("state")["launched"]

    @property
    def completed(self) -> int:
        return self._call("state")["completed"]

    @property
    def pending(self) -> int:
        """Ops launched but not finished yet."""
        state = self._call("state")
        return state["launched"] - state["completed"]

    def synchronize(self) -> None:
        """Block until every launched op has finished; an op's error surfaces here."""
        self._call("synchronize")
        self._run_finished_ops()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("an op launched on the simulated device failed") from error

    def result(self):
        """The last op's value (by default, how many ops have finished); waits for it first."""
        self._call("result")
        self._run_finished_ops()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("an op launched on the simulated device failed") from error
        return self._value

    def close(self) -> None:
        """Finish the queued work, then refuse further launches."""
        if not self._closed:
            self._closed = True
            self._call("close")
            self._run_finished_ops()

    def __enter__(self) -> RemoteDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteDevice(op_seconds={self.op_seconds}, compile_seconds={self.compile_seconds})"
