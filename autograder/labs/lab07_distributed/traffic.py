"""A world's traffic as the grader's relay logged it (``autograder/engine/relay.py``), read for lab 07.

Every figure here comes from the relay's records, kept in the grading process: which operations
crossed, their dtype, elements and bytes, who sent to whom, and the relay's clock at each rank's
arrival. No rank counts anything the check reads here.

Phases are cut by the grader's own barriers: each rank's drive (``ranks.py``) calls
``dist.barrier()`` after every step or trial, and every rank's collectives are matched by their
place in its sequence, so the collectives between two barriers are that phase's, on every rank.
A rank's point-to-point messages belong to the phase in which they reached the relay, between
that rank's own arrivals at the barriers around it. A student's code that calls a barrier of its
own shows as one phase too many, which every check names.

A *mark* (``relay_backend.mark``) is where a rank's program says it is, stamped with the relay's
clock on arrival: the only figure here a rank chooses, so what rests on it is self-reported.
"""

from __future__ import annotations

from collections import Counter

DATA_GATHERS = ("all_gather_single", "all_gather")
DATA_REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter")


def collectives(records: list[dict]) -> list[dict]:
    """The world's collectives in every rank's order."""
    return sorted((r for r in records if r["kind"] == "collective"), key=lambda r: r["seq"])


def phases(records: list[dict]) -> list[list[dict]]:
    """The collectives between the barriers: ``phases[0]`` before the first one, ``phases[k]``
    between the k-th and the next (the last after the last barrier)."""
    found: list[list[dict]] = [[]]
    for record in collectives(records):
        if record["op"] == "barrier":
            found.append([])
        else:
            found[-1].append(record)
    return found


def barrier_problem(records: list[dict], expected: int) -> str | None:
    """Why the world's barriers are not the grader's ``expected`` ones, or None."""
    got = sum(1 for r in collectives(records) if r["op"] == "barrier")
    if got == expected:
        return None
    return (f"the relay saw {got} barriers where the grader's drive calls {expected}: a barrier of the "
            "submission's own, or collectives out of step with the grader's")


def sends(records: list[dict], rank: int) -> list[list[dict]]:
    """``rank``'s point-to-point messages, phase by phase (as ``phases`` cuts them, by when this
    rank reached each barrier)."""
    edges = [r["arrived_s"].get(rank, float("inf")) for r in collectives(records) if r["op"] == "barrier"]
    found: list[list[dict]] = [[] for _ in range(len(edges) + 1)]
    for record in records:
        if record["kind"] == "p2p" and record["src"] == rank:
            arrived = record["arrived_s"][rank]
            found[sum(1 for edge in edges if edge < arrived)].append(record)
    return found


def shown_ops(ops: list[dict]) -> str:
    """``all_reduce x3, broadcast``: what a phase held, for a reason."""
    counts = Counter(r["op"] for r in ops)
    return ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items()) or "nothing"


def marks(records: list[dict], rank: int) -> dict[str, float]:
    """``rank``'s marks: label -> the relay's clock when it arrived (the first of a repeated label)."""
    found: dict[str, float] = {}
    for record in records:
        if record["kind"] == "mark" and record["src"] == rank:
            found.setdefault(record["label"], record["arrived_s"][rank])
    return found


def peaks(world: dict) -> list[int]:
    """Each rank child's memory peak, from its cgroup (``Observed.worlds``)."""
    return [int(rank.get("peak_bytes", 0)) for rank in world["ranks"]]
