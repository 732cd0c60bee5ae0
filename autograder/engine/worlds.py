"""Items graded as worlds of ranks (``items.Worlds``, lab 07): one sandbox per rank, the relay between them.

A world of ranks started inside one sandbox shares that sandbox: its ranks can meet over loopback,
a file in ``/tmp``, a shared-memory segment or a store's socket, around any collective the grader
refuses, and whatever the ranks count about their traffic is counted where the student's code
runs. Here no rank shares anything with another. For each world an item asks for, the grader

- binds a ``relay.Relay`` in this process, one Unix socket per rank, each in that rank's own job
  folder (``relay_protocol.SOCKET``): the socket a message arrives on *is* the rank;
- starts one grading child per rank (``child.py``, mode "rank"), forked warm from the fork server
  like every other child, each in a sandbox of its own (own mount, pid, ipc and network
  namespaces, own ``/tmp`` and ``/dev/shm``, no loopback to anyone, its own cgroup). The only
  way out of a rank's sandbox is its own relay socket and its grading channel; it joins the
  world before any student code exists in it;
- sends each rank only what that rank may know (``Worlds.rank_inputs``: its own shard, its own
  tensor), and runs the item's ``drive`` there;
- hands the check every rank's outputs, the relay's log of the world (every collective and
  message: op, dtype, shape, bytes each rank handed over and received, source, destination,
  tag, sequence, this process's clock at arrival and completion) and each rank child's memory
  peak, measured from outside it (``Observed.worlds``).

A world that deadlocks, mismatches or loses a rank fails at the relay, within its timeout, with a
named reason; a rank child that crashes, runs out of time or memory makes the relay answer every
other rank at once (``Relay.abort``). Either way that is the item's verdict, never the batch's.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from autograder.engine import artefacts, grade, relay_protocol
from autograder.engine.items import Item, LabSpec, Observed
from autograder.engine.relay import Relay
from autograder.records import clean_reason

# How long after its ranks' children have ended the grader waits for the relay to see them leave.
SETTLE_S = 2.0
# How long after the world has failed a rank child still running may take to hear of it and end:
# one that does not (busy in a loop of its own, never asking the relay) is then stopped.
GRACE_S = 2.0
TICK_S = 0.05
# How often a rank child's watchdog reads the process table: a dozen rank children may run at
# once, and each has a jail whose kernel limits (pids, memory) act between two samples.
RANK_SAMPLE_S = 0.25
# Beyond a rank child's own wall limit (enforced by its watchdog), how long the grader waits for it.
JOIN_SLACK_S = 30.0


@dataclass
class WorldRun:
    """One world's end: each rank child's run (``grade._Run``; None where the grader lost it), the
    relay's log and why the world failed, if it did."""

    index: int
    size: int
    runs: list = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    failure: str | None = None
    wall_s: float = 0.0
    stopped: set[int] = field(default_factory=set)  # ranks the grader stopped once the world had failed

    def figures(self) -> dict:
        """What a check reads of this world (``Observed.worlds``)."""
        return {"size": self.size, "records": self.records, "failure": self.failure,
                "ranks": [{"peak_bytes": r.result.peak_bytes, "peak_source": r.result.peak_source,
                           "wall_s": r.result.wall_s, "processes": r.result.processes}
                          if r is not None else {} for r in self.runs]}


def _rank_inputs(item: Item, inputs: dict, index: int, rank: int, size: int) -> dict:
    spec = item.worlds
    return {**spec.rank_inputs(inputs, index, rank), "world": index, "rank": rank, "world_size": size,
            "timeout_s": float(inputs.get("timeout_s", spec.timeout_s))}


def run_world(lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, index: int, size: int,
              sandbox: grade.Sandbox, params: dict, *, reference: bool = False) -> WorldRun:
    """Run world ``index`` of ``item`` (``size`` ranks) to its end. Raises
    ``artefacts.ArtefactRejected`` before anything starts when the student's cells are refused."""
    spec = item.worlds
    timeout_s = float(inputs.get("timeout_s", spec.timeout_s))
    works: list[grade._Workdir] = []
    world = WorldRun(index, size, [None] * size)
    started = time.monotonic()
    try:
        for rank in range(size):
            works.append(grade._Workdir(lab, item, cells, _rank_inputs(item, inputs, index, rank, size), mode="rank",
                                        params=params, within=sandbox.scratch, reference=reference))
        # 0o666: the rank runs as the sandbox's uid; its folder, the only one that holds the socket,
        # is shown to that rank's sandbox alone.
        relay = Relay([os.path.join(w.path, relay_protocol.SOCKET) for w in works], timeout_s=timeout_s,
                      max_message_bytes=spec.max_message_bytes, max_operations=spec.max_operations,
                      socket_mode=0o666)
        limits = grade._item_limits(item, sandbox.profile)
        limits.sample_s = RANK_SAMPLE_S
        jails: list = [None] * size

        def rank_main(rank: int) -> None:
            def started(jail) -> None:
                jails[rank] = jail

            run = grade._run_child(works[rank], limits, sandbox, started=started)
            world.runs[rank] = run
            if not run.result.ok:
                # The others need not wait out the timeout for a rank whose sandbox has gone.
                relay.abort(f"rank {rank} left the world: its process ended ({run.result.reason})")

        with relay:
            threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True, name=f"fastdl-rank-{rank}")
                       for rank in range(size)]
            for thread in threads:
                thread.start()
            _wait(threads, relay, jails, world, limits.wall_s + JOIN_SLACK_S)
            relay.wait_ended(SETTLE_S)
            world.records, world.failure = relay.records(), relay.failure
    finally:
        for work in works:
            work.remove()
    world.wall_s = time.monotonic() - started
    return world


def run_worlds(lab: LabSpec, item: Item, cells: dict[str, str], inputs: dict, worlds: list[tuple[int, int]],
               sandbox: grade.Sandbox, params: dict, *, reference: bool = False) -> list[WorldRun]:
    """Run the ``(index, size)`` worlds of ``item`` all at once, each in threads of its own: a
    world spends most of its time starting and ending its ranks' children, which overlap."""
    done: dict[int, WorldRun] = {}
    raised: list[BaseException] = []

    def one(index: int, size: int) -> None:
        try:
            done[index] = run_world(lab, item, cells, inputs, index, size, sandbox, params, reference=reference)
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            raised.append(exc)

    threads = [threading.Thread(target=one, args=world, daemon=True, name=f"fastdl-world-{world[0]}")
               for world in worlds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if raised:
        raise raised[0]
    return [done[index] for index, _ in worlds]


def _wait(threads: list[threading.Thread], relay: Relay, jails: list, world: WorldRun, limit_s: float) -> None:
    """Until every rank child has ended: once the world has failed, a rank still running after
    ``GRACE_S`` is stopped (every process of its cgroup), so that a world ends with its failure."""
    deadline = time.monotonic() + limit_s
    failed_at = None
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        threads[[t.is_alive() for t in threads].index(True)].join(TICK_S)
        if failed_at is None and relay.failure is not None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for rank, thread in enumerate(threads):
                if thread.is_alive() and jails[rank] is not None and rank not in world.stopped:
                    world.stopped.add(rank)
                    _stop(jails[rank])


def _stop(jail) -> None:
    for pid in jail.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _consequence(run) -> bool:
    """A rank that failed only because the relay told it the world had failed."""
    errors = run.received.errors
    return run.result.status == "error" and bool(errors) and "relay: " in errors[0]["error"]


def world_failure(item: Item, world: WorldRun, label: str) -> grade.ItemResult | None:
    """The item's verdict when the world did not end well: the first rank that failed of its own
    doing (a raise, a crash, a limit), else the relay's reason; None for a world that ended well."""
    failed = [(rank, run) for rank, run in enumerate(world.runs) if run is None or not run.result.ok]
    if not failed and world.failure is None:
        return None
    for rank, run in failed:
        if rank in world.stopped:
            continue
        if run is None:
            return grade.ItemResult(item.name, 0.0, item.points, "not_graded",
                                    f"{label}: the grader lost rank {rank}'s child (a fault of the grading machine)")
        if not _consequence(run):
            result = grade._failure(item, run)
            result.reason = clean_reason(f"{label}, rank {rank}: {result.reason}")
            return result
    why = world.failure or next((grade._failure(item, run).reason for _, run in failed if run is not None),
                                "its ranks were stopped")
    return grade.ItemResult(item.name, 0.0, item.points, "error",
                            clean_reason(f"{label}: the world failed: {grade.redact_numbers(why)}"))


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
        figures: dict = {"status": "ok", "reason": "", "worlds": {}}
        wanted = [(index, sizes[index]) for index in item.worlds.reference_worlds(inputs)]
        for world in run_worlds(lab, item, {}, inputs, wanted, sandbox, params, reference=True):
            index = world.index
            failed = world_failure(item, world, f"reference world {index}")
            if failed is not None:
                figures = {"status": "failed", "reason": failed.reason, "worlds": {}}
                break
            figures["worlds"][index] = world.figures()
        _REFERENCE[key] = figures
        return figures


def grade_worlds(lab: LabSpec, item: Item, cells: dict[str, str], sandbox: grade.Sandbox, params: dict,
                 inputs: dict) -> grade.ItemResult:
    """Grade ``item`` (``Item.worlds``): every world it asks for, at once; the first that failed (in
    the item's order) is the item's verdict; else the check, on every rank's outputs and the
    relay's logs."""
    spec = item.worlds
    sizes = spec.sizes(inputs)
    reference: dict = {}
    if spec.reference_worlds is not None:
        reference = reference_figures(lab, item, params, sandbox)
        if reference.get("status") != "ok":
            return grade.ItemResult(item.name, 0.0, item.points, "not_graded",
                                    clean_reason(f"the grader's reference run failed ({reference.get('reason')}): a "
                                                 "fault of the grading machine, not of the submission"))
    if item.artefacts:
        try:  # before any world starts: every rank's folder would refuse the same cells
            artefacts.extract([cells[c] for c in item.cells], item.artefacts, item.library)
        except artefacts.ArtefactRejected as exc:
            return grade.ItemResult(item.name, 0.0, item.points, "rejected", clean_reason(str(exc)))
    started = time.monotonic()
    worlds = run_worlds(lab, item, cells, inputs, list(enumerate(sizes)), sandbox, params)
    for world in worlds:
        failed = world_failure(item, world, f"world {world.index + 1} of {len(sizes)} ({world.size} ranks)")
        if failed is not None:
            failed.wall_s = time.monotonic() - started
            return failed
    wall_s = time.monotonic() - started
    outputs = []
    for world in worlds:
        per_rank = []
        for rank, run in enumerate(world.runs):
            try:
                per_rank.append(grade._outputs(run))
            except grade._Refused as exc:
                return grade.ItemResult(item.name, 0.0, item.points, exc.status,
                                        clean_reason(f"world {world.index + 1}, rank {rank}: {exc.reason}"),
                                        wall_s=wall_s)
        outputs.append(per_rank)
    runs = [run for world in worlds for run in world.runs]
    peak = max(runs, key=lambda r: r.result.peak_bytes)
    observed = Observed(peak_bytes=peak.result.peak_bytes, peak_source=peak.result.peak_source, wall_s=wall_s,
                        processes=max(r.result.processes for r in runs), worlds=[w.figures() for w in worlds],
                        reference=reference)
    verdict = grade._judge(item, inputs, outputs, params, observed)
    return grade._from_verdict(item, verdict, wall_s)
