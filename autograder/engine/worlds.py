"""Items graded as worlds of ranks (``items.Worlds``, lab 07): one sandbox per rank, the relay between them.

A world of ranks started inside one sandbox shares that sandbox: its ranks can meet over loopback,
a file in ``/tmp``, a shared-memory segment or a store's socket, around any collective the grader
refuses, and whatever the ranks count about their traffic is counted where the student's code
runs. Here no rank shares anything with another. For each world an item asks for, the grader

- binds a ``relay.Relay`` in this process, one Unix socket per rank, each in that rank's own job
  folder (``relay-<world>.sock``): the socket a message arrives on *is* the rank;
- runs each rank in a grading child of its own (``child.py``, mode "rank"), forked warm from the
  fork server like every other child, in a sandbox of its own (own mount, pid, ipc and network
  namespaces, own ``/tmp`` and ``/dev/shm``, no loopback to anyone, its own cgroup). The only
  ways out of a rank's sandbox are its relay sockets and its grading channel; it joins its first
  world before any student code exists in it;
- sends each rank only what that rank may know (``Worlds.rank_inputs``: its own shard, its own
  tensor), and runs the item's ``drive`` there;
- hands the check every rank's outputs, the relay's log of each world (every collective and
  message: op, dtype, shape, bytes each rank handed over and received, source, destination,
  tag, sequence, this process's clock at arrival and completion) and each rank child's memory
  peak, measured from outside it (``Observed.worlds``).

A sandbox costs about 70 ms of CPU to make and end, more than most worlds' work, so the worlds of
an item share their rank children: child k is rank k of every world with more than k ranks, one
world after another, each world behind a relay of its own. What a child carries from one world to
the next is its own rank's inputs, never another rank's. A world whose figures are compared with
a reference run (``Worlds.reference_worlds``: a memory peak) gets fresh children of its own, as
the reference's are.

A world that deadlocks, mismatches or loses a rank fails at its relay, within its timeout, with a
named reason; a rank child that crashes, runs out of time or memory makes the relays of its
worlds answer every other rank at once (``Relay.abort``). Either way that is the item's verdict,
never the batch's.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from autograder.engine import artefacts, grade
from autograder.engine.items import Item, LabSpec, Observed
from autograder.engine.relay import Relay
from autograder.records import clean_reason

# How long after its ranks' children have ended the grader waits for the relays to see them leave.
SETTLE_S = 2.0
# How long after a world has failed a rank child still running may take to hear of it and end:
# one that does not (busy in a loop of its own, never asking the relay) is then stopped.
GRACE_S = 2.0
TICK_S = 0.05
# How often a rank child's watchdog reads the process table: a dozen rank children may run at
# once, and each has a jail whose kernel limits (pids, memory) act between two samples.
RANK_SAMPLE_S = 0.25
# Beyond a rank child's own wall limit (enforced by its watchdog), how long the grader waits for it.
JOIN_SLACK_S = 30.0


def socket_name(world: int) -> str:
    """A rank's socket to the relay of ``world``, in the rank's own job folder."""
    return f"relay-{world}.sock"


@dataclass(eq=False)
class RankChild:
    """One rank's sandboxed child, and its seat in each of its worlds: ``seats`` are (world, rank)."""

    seats: list[tuple[int, int]]
    run: object = None  # grade._Run once it has ended; None if the grader lost it
    jail: object = None
    stopped: bool = False  # by the grader, once a world had failed

    def outputs(self) -> list:
        """What it delivered: one entry per seat, in order (``grade._Refused`` otherwise)."""
        delivered = grade._outputs(self.run)
        if not isinstance(delivered, list) or len(delivered) != len(self.seats):
            raise grade._Refused("failed", "a rank's runner did not deliver one result per world")
        return delivered


@dataclass
class WorldRun:
    """One world's end: the relay's log, why it failed (if it did), and its ranks' children."""

    index: int
    size: int
    ranks: list[RankChild] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    failure: str | None = None

    def figures(self) -> dict:
        """What a check reads of this world (``Observed.worlds``). A rank's peak is its child's,
        over every world that child held a seat in."""
        return {"size": self.size, "records": self.records, "failure": self.failure,
                "ranks": [{"peak_bytes": c.run.result.peak_bytes, "peak_source": c.run.result.peak_source,
                           "wall_s": c.run.result.wall_s, "processes": c.run.result.processes}
                          if c.run is not None else {} for c in self.ranks]}

    def outputs(self) -> list:
        return [child.outputs()[child.seats.index((self.index, rank))] for rank, child in enumerate(self.ranks)]


def _seat_inputs(item: Item, inputs: dict, world: int, rank: int, size: int) -> dict:
    spec = item.worlds
    return {**spec.rank_inputs(inputs, world, rank), "world": world, "rank": rank, "world_size": size,
            "timeout_s": float(inputs.get("timeout_s", spec.timeout_s)), "socket": socket_name(world)}


def _children(worlds: list[tuple[int, int]], dedicated: set[int]) -> list[RankChild]:
    """The rank children of ``worlds`` ((index, size), in order): child k of the shared ones is
    rank k of each shared world larger than k; each dedicated world has children of its own."""
    shared = [(index, size) for index, size in worlds if index not in dedicated]
    children = [RankChild([(index, k) for index, size in shared if size > k])
                for k in range(max((size for _, size in shared), default=0))]
    for index, size in worlds:
        if index in dedicated:
            children += [RankChild([(index, k)]) for k in range(size)]
    return children


def run_worlds(lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, worlds: list[tuple[int, int]],
               sandbox: grade.Sandbox, params: dict, *, reference: bool = False,
               dedicated: set[int] = frozenset()) -> dict[int, WorldRun]:
    """Run the ``(index, size)`` worlds of ``item`` to their end, all their children at once (the
    worlds of a shared child one after another). Raises ``artefacts.ArtefactRejected`` before
    anything starts when the student's cells are refused."""
    spec = item.worlds
    timeout_s = float(inputs.get("timeout_s", spec.timeout_s))
    children = _children(worlds, dedicated)
    runs = {index: WorldRun(index, size, [None] * size) for index, size in worlds}
    sizes = dict(worlds)
    works: list[grade._Workdir] = []
    relays: dict[int, Relay] = {}
    try:
        for child in children:
            seats = [_seat_inputs(item, inputs, index, rank, sizes[index]) for index, rank in child.seats]
            works.append(grade._Workdir(lab, item, cells, {"seats": seats}, mode="rank", params=params,
                                        within=sandbox.scratch, reference=reference))
            for index, rank in child.seats:
                runs[index].ranks[rank] = child
        for index, size in worlds:
            # 0o666: the rank runs as the sandbox's uid; its folder, the only one that holds the
            # socket, is shown to that rank's sandbox alone.
            paths = [os.path.join(works[children.index(child)].path, socket_name(index))
                     for child in runs[index].ranks]
            relays[index] = Relay(paths, timeout_s=timeout_s, max_message_bytes=spec.max_message_bytes,
                                  max_operations=spec.max_operations, socket_mode=0o666).start()
        limits = grade._item_limits(item, sandbox.profile)
        limits.sample_s = RANK_SAMPLE_S

        def child_main(child: RankChild, work: grade._Workdir) -> None:
            def started(jail) -> None:
                child.jail = jail

            child.run = grade._run_child(work, limits, sandbox, started=started)
            if not child.run.result.ok:
                # The others need not wait out the timeout for a rank whose sandbox has gone.
                for index, rank in child.seats:
                    if not relays[index].wait_ended(0):
                        relays[index].abort(f"rank {rank} left the world: its process ended "
                                            f"({child.run.result.reason})")

        threads = [threading.Thread(target=child_main, args=(child, work), daemon=True, name="fastdl-rank")
                   for child, work in zip(children, works)]
        for thread in threads:
            thread.start()
        _wait(threads, list(relays.values()), children, limits.wall_s + JOIN_SLACK_S)
        for index, relay in relays.items():
            relay.wait_ended(SETTLE_S)
            runs[index].records, runs[index].failure = relay.records(), relay.failure
    finally:
        for relay in relays.values():
            relay.close()
        for work in works:
            work.remove()
    return runs


def _wait(threads: list[threading.Thread], relays: list[Relay], children: list[RankChild], limit_s: float) -> None:
    """Until every rank child has ended: once a world has failed, a child still running after
    ``GRACE_S`` is stopped (every process of its cgroup), so that the item ends with the failure."""
    deadline = time.monotonic() + limit_s
    failed_at = None
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        threads[[t.is_alive() for t in threads].index(True)].join(TICK_S)
        if failed_at is None and any(relay.failure is not None for relay in relays):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for thread, child in zip(threads, children):
                if thread.is_alive() and child.jail is not None and not child.stopped:
                    child.stopped = True
                    _stop(child.jail)


def _stop(jail) -> None:
    for pid in jail.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _consequence(run) -> bool:
    """A rank that failed only because the relay told it its world had failed."""
    errors = run.received.errors
    return run.result.status == "error" and bool(errors) and "relay: " in errors[0]["error"]


def failure(item: Item, worlds: dict[int, WorldRun], label) -> grade.ItemResult | None:
    """The item's verdict when a world did not end well: a rank that failed of its own doing (a
    raise, a crash, a limit), named in the first world it left failing; else the first world's
    failure the relays saw; None when every world ended well. ``label(index)`` names a world."""
    order = sorted(worlds)
    children = []
    for index in order:
        children += [child for child in worlds[index].ranks if child not in children]
    for child in children:
        if child.stopped or (child.run is not None and child.run.result.ok):
            continue
        index, rank = next(((i, r) for i, r in child.seats if worlds[i].failure is not None), child.seats[0])
        if child.run is None:
            return grade.ItemResult(item.name, 0.0, item.points, "not_graded",
                                    f"{label(index)}: the grader lost rank {rank}'s child (a fault of the grading "
                                    "machine)")
        if not _consequence(child.run):
            result = grade._failure(item, child.run)
            result.reason = clean_reason(f"{label(index)}, rank {rank}: {result.reason}")
            return result
    for index in order:
        if worlds[index].failure is not None:
            return grade.ItemResult(item.name, 0.0, item.points, "error", clean_reason(
                f"{label(index)}: the world failed: {grade.redact_numbers(worlds[index].failure)}"))
    for child in children:  # a rank that says the relay failed it, where the relay saw nothing wrong
        if not child.stopped and child.run is not None and not child.run.result.ok:
            result = grade._failure(item, child.run)
            result.reason = clean_reason(f"{label(child.seats[0][0])}, rank {child.seats[0][1]}: {result.reason}")
            return result
    return None


# The reference worlds' figures per (lab, item, parameters, profile): they depend on the item's
# sizes, never on one student's values, so one trusted run serves a grading process.
_REFERENCE: dict[tuple, dict] = {}
_REFERENCE_LOCK = threading.Lock()


def reference_figures(lab: LabSpec, item: Item, params: dict, sandbox: grade.Sandbox) -> dict:
    """The figures of the worlds ``Worlds.reference_worlds`` names, run with the course's own
    implementation in trusted rank children of the same sandbox and limits: {"status", "reason",
    "worlds": {index: figures}}."""
    import json

    key = (lab.name, item.name, json.dumps(params, sort_keys=True, default=str), sandbox.profile.get("name"),
           sandbox.isolated)
    with _REFERENCE_LOCK:
        if key in _REFERENCE:
            return _REFERENCE[key]
        inputs = item.make_inputs(grade.REFERENCE_SEED, params)
        sizes = item.worlds.sizes(inputs)
        wanted = [(index, sizes[index]) for index in item.worlds.reference_worlds(inputs)]
        worlds = run_worlds(lab, item, {}, inputs, wanted, sandbox, params, reference=True,
                            dedicated={index for index, _ in wanted})
        failed = failure(item, worlds, lambda index: f"reference world {index + 1}")
        figures = {"status": "ok", "reason": "", "worlds": {index: world.figures() for index, world in worlds.items()}}
        if failed is not None:
            figures = {"status": "failed", "reason": failed.reason, "worlds": {}}
        _REFERENCE[key] = figures
        return figures


def grade_worlds(lab: LabSpec, item: Item, cells: dict[str, str], sandbox: grade.Sandbox, params: dict,
                 inputs: dict) -> grade.ItemResult:
    """Grade ``item`` (``Item.worlds``): every world it asks for; the first failure is the item's
    verdict; else the check, on every rank's outputs and the relays' logs."""
    spec = item.worlds
    sizes = spec.sizes(inputs)
    reference: dict = {}
    dedicated: set[int] = set()
    if spec.reference_worlds is not None:
        dedicated = set(spec.reference_worlds(inputs))
        reference = reference_figures(lab, item, params, sandbox)
        if reference.get("status") != "ok":
            return grade.ItemResult(item.name, 0.0, item.points, "not_graded",
                                    clean_reason(f"the grader's reference run failed ({reference.get('reason')}): a "
                                                 "fault of the grading machine, not of the submission"))
    if item.artefacts:
        try:  # before any child starts: every rank's folder would refuse the same cells
            artefacts.extract([cells[c] for c in item.cells], item.artefacts, item.library)
        except artefacts.ArtefactRejected as exc:
            return grade.ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    started = time.monotonic()
    worlds = run_worlds(lab, item, cells, inputs, list(enumerate(sizes)), sandbox, params, dedicated=dedicated)
    wall_s = time.monotonic() - started

    def label(index: int) -> str:
        return f"world {index + 1} of {len(sizes)} ({sizes[index]} ranks)"

    failed = failure(item, worlds, label)
    if failed is not None:
        failed.wall_s = wall_s
        return failed
    outputs = []
    for index in range(len(sizes)):
        try:
            outputs.append(worlds[index].outputs())
        except grade._Refused as exc:
            return grade.ItemResult(item.name, 0.0, item.points, exc.status,
                                    clean_reason(f"{label(index)}: {exc.reason}"), wall_s=wall_s)
    runs = [child.run for index in range(len(sizes)) for child in worlds[index].ranks]
    peak = max(runs, key=lambda r: r.result.peak_bytes)
    observed = Observed(peak_bytes=peak.result.peak_bytes, peak_source=peak.result.peak_source, wall_s=wall_s,
                        processes=max(r.result.processes for r in runs),
                        worlds=[worlds[index].figures() for index in range(len(sizes))], reference=reference)
    verdict = grade._judge(item, inputs, outputs, params, observed)
    return grade._from_verdict(item, verdict, wall_s)
