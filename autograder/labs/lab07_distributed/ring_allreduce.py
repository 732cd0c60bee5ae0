"""Lab 07's ring all-reduce item: exact sums, and the ring's traffic as the relay carried it.

Each rank of a world is sent only its own tensor of each trial (integers in float32, which add
exactly in any order), drawn here from the secret seed: the sum exists nowhere but in the grader
until the ranks have moved it through the relay. The check then reads, per rank and trial, from
the relay's log: that only point-to-point messages crossed (the grader's barriers between trials
aside), each to the rank's right neighbour, the exact bytes of the ring (``ring.ring_bytes_ref``)
in the ring's chunks (``torch.tensor_split``'s, one per step), and that the count the student's
function returned is the bytes the relay saw it send.
"""

from __future__ import annotations

import random
from collections import Counter

import torch

from autograder.engine.items import Verdict
from autograder.labs._common import per_case
from autograder.labs.lab07_distributed import traffic
from fastdl_lab import checks
from fastdl_lab.distributed import ring


def ring_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    worlds = [[world, rng.sample(list(sizes), min(3, len(sizes)))] for world, sizes in params["worlds"]]
    generator = torch.Generator().manual_seed(rng.randint(0, 2**62))
    tensors = [[[torch.randint(-50, 51, (numel,), generator=generator).float() for numel in sizes]
                for _ in range(world)] for world, sizes in worlds]
    return {"worlds": worlds, "tensors": tensors}


def ring_sizes(inputs: dict) -> list[int]:
    return [world for world, _ in inputs["worlds"]]


def ring_rank_inputs(inputs: dict, world: int, rank: int) -> dict:
    return {"tensors": inputs["tensors"][world][rank]}


def ring_chunks(numel: int, world_size: int, rank: int) -> Counter:
    """Elements of each message ``ring_allreduce_ref`` sends from ``rank`` (empty chunks are not sent):
    chunk (rank - s) mod N at step s of the reduce-scatter, chunk (rank + 1 - s) mod N of the all-gather."""
    sizes = ring.chunk_sizes(numel, world_size)
    sent = [sizes[(rank - s) % world_size] for s in range(world_size - 1)]
    sent += [sizes[(rank + 1 - s) % world_size] for s in range(world_size - 1)]
    return Counter(n for n in sent if n)


def traffic_problem(records: list[dict], trials: int) -> str | None:
    """What the world did besides point-to-point messages and the grader's barriers."""
    others = [r for r in traffic.collectives(records) if r["op"] != "barrier"]
    if others:
        return (f"the relay carried {traffic.shown_ops(others)}: a collective, where the ring may only use "
                "send/recv (isend/irecv)")
    return traffic.barrier_problem(records, trials)


def rank_problem(records: list[dict], rank: int, world_size: int, trial: int, numel: int, reported) -> str | None:
    """What is wrong with ``rank``'s messages in ``trial``, as the relay carried them."""
    mine = traffic.sends(records, rank)[trial]
    right = (rank + 1) % world_size
    astray = sorted({r["dst"] for r in mine if r["dst"] != right})
    if astray:
        return f"sent to ranks {astray}; a ring sends only to its right neighbour, rank {right}"
    if any(r["dtype"] != "float32" for r in mine):
        return "sent tensors that are not float32: the ring sends chunks of the tensor itself"
    sent = sum(r["sent_bytes"].get(rank, 0) for r in mine)
    want = ring.ring_bytes_ref(numel, 4, world_size, rank)
    if sent != want:
        return f"sent {sent} bytes through the relay; the ring sends {want}"
    chunks = Counter(int(r["numel"]) for r in mine if r["numel"])
    expected = ring_chunks(numel, world_size, rank)
    if chunks != expected:
        return (f"sent messages of {sorted(chunks.elements())} elements; the ring sends one chunk per step, "
                f"{sorted(expected.elements())}")
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or reported != sent:
        return f"returned {reported!r} as the bytes it sent, but the relay carried {sent} from this rank"
    return None


def ring_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    labels, cases = [], []
    for w, (world, sizes) in enumerate(inputs["worlds"]):
        for j, numel in enumerate(sizes):
            labels.append(f"{world} ranks, numel {numel}")
            cases.append((w, j, numel))

    def check_one(i: int) -> None:
        w, j, numel = cases[i]
        world, sizes = inputs["worlds"][w]
        records = observed.worlds[w]["records"]
        expected = sum(inputs["tensors"][w][r][j] for r in range(world))
        problem = traffic_problem(records, len(sizes))
        if problem:
            raise checks.MismatchError(problem)
        for rank, results in enumerate(outputs[w]):
            where = f"ring_allreduce, {world} ranks, numel {numel}, rank {rank}"
            result = results[j]
            checks.assert_close(result["out"], expected, atol=0.0, rtol=0.0, name=where)
            problem = rank_problem(records, rank, world, j, numel, result["reported"])
            if problem:
                raise checks.MismatchError(f"{where}: {problem} (the relay's log)")

    verdict = per_case(labels, check_one)
    if verdict.fraction == 1:
        verdict.reason += ("; sums exact, and the relay carried each rank's ring: its bytes, its chunks, right "
                           "neighbour only")
    return verdict
