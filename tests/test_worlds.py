"""Items graded as worlds of ranks (autograder/engine/worlds.py): one sandboxed child per rank, the
grader's relay between them. A rank that dies, hangs or floods fails its item within the relay's
timeout, with the reason, and leaves nothing running; ranks share no file, no shared memory and no
network; what the check reads of a world comes from the relay and the ranks' cgroups.

The ranks run lab 07's ring item with student cells written for each case (screened as any
student's are), on small worlds and short timeouts: seconds per test."""

from __future__ import annotations

import time

import pytest
import torch

from autograder.engine import grade, prefork, worlds
from autograder.engine.grade import Sandbox, grade_submission
from autograder.engine.items import load_lab
from autograder.engine.sandbox import descendants
from autograder.labs.lab07_distributed import traffic
from autograder.submissions import make_submission, reference_solutions
from fastdl_lab.distributed import ring

pytestmark = pytest.mark.distributed
LAB = "07_distributed"
TIMEOUT_S = 2.0


def _ring(course, student: str, source: str) -> str:
    make_submission(course, LAB, student, {**reference_solutions(course, LAB), "ring_code": source})
    return student


def _profile(cpu: dict, sizes=(5,), world: int = 2, timeout_s: float = TIMEOUT_S) -> dict:
    labs = {name: dict(items) for name, items in cpu["labs"].items()}
    labs[LAB] = {**labs[LAB], "ring_allreduce": {"worlds": [[world, list(sizes)]], "rank_timeout_s": timeout_s}}
    return {**cpu, "labs": labs}


def _grade(course, profile: dict, student: str, item: str = "ring_allreduce"):
    [result] = grade_submission(load_lab(LAB), course.submitted(student, LAB), release=course.release(LAB),
                                profile=profile, seed=5, student_package=course.student_package, only={item})
    return result


def _leftovers() -> list[int]:
    """Processes of any sandbox this process's fork servers forked that are still there."""
    return [pid for server in prefork.server_pids() for pid in descendants(server)[1:]]


def test_the_reference_ring_passes_on_the_relay_log_and_each_rank_has_its_own_peak(course, cpu):
    lab, sandbox = load_lab(LAB), Sandbox(course.student_package, _profile(cpu))
    item = lab.item("ring_allreduce")
    params = {"worlds": [[3, [7, 4]]], "rank_timeout_s": 10.0}
    inputs = item.make_inputs(3, params)
    cells = reference_solutions(course, LAB)
    world = worlds.run_worlds(lab, item, cells, inputs, [(0, 3)], sandbox, params)[0]
    assert world.failure is None and all(child.run.result.ok for child in world.ranks)
    # Two trials, a grader's barrier after each; six messages per rank, each to its right neighbour.
    assert [r["op"] for r in traffic.collectives(world.records)] == ["barrier", "barrier"]
    for rank in range(3):
        first, second, after = traffic.sends(world.records, rank)
        assert {r["dst"] for r in first + second} == {(rank + 1) % 3} and after == []
        assert sum(r["sent_bytes"][rank] for r in first) == ring.ring_bytes_ref(7, 4, 3, rank)
        assert sum(r["sent_bytes"][rank] for r in second) == ring.ring_bytes_ref(4, 4, 3, rank)
    figures = world.figures()
    assert [r["peak_source"] for r in figures["ranks"]] == ["cgroup"] * 3
    assert all(r["peak_bytes"] > 0 for r in figures["ranks"])
    # Each rank was sent its own tensors only, and holds the sum of all of them.
    outputs = world.outputs()
    for j in range(2):
        expected = sum(inputs["tensors"][0][r][j] for r in range(3))
        for rank in range(3):
            torch.testing.assert_close(outputs[rank][j]["out"], expected, rtol=0, atol=0)


def test_a_rank_that_dies_fails_the_item_at_once_with_its_own_reason(course, cpu):
    student = _ring(course, "world-dies", '''
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    dist.recv(torch.empty_like(tensor), src=1)
    return 0
''')
    started = time.monotonic()
    result = _grade(course, _profile(cpu, timeout_s=15.0), student)
    assert result.status == "error" and result.score == 0, result
    assert "rank 1" in result.reason and "gives up" in result.reason, result.reason
    # The relay answered rank 0 when rank 1's sandbox ended, not at the 15 s timeout.
    assert time.monotonic() - started < 10
    assert _leftovers() == []


def test_a_rank_that_hangs_fails_the_world_at_the_timeout_and_is_stopped(course, cpu):
    student = _ring(course, "world-hangs", '''
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    if dist.get_rank() == 1:
        while True:
            pass
    dist.recv(torch.empty_like(tensor), src=1)
    return 0
''')
    started = time.monotonic()
    result = _grade(course, _profile(cpu), student)
    assert result.status == "error" and result.score == 0, result
    assert "recv" in result.reason and "timed out" in result.reason and "rank 0" in result.reason, result.reason
    # The timeout, then the grace a running rank gets to end: never the profile's wall limit.
    assert time.monotonic() - started < TIMEOUT_S + worlds.GRACE_S + 8
    assert _leftovers() == []


def test_a_rank_that_floods_the_relay_is_refused(course, cpu):
    student = _ring(course, "world-floods", '''
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    if dist.get_rank() == 0:
        for _ in range(64):
            dist.send(torch.ones(250_000), 1)
    else:
        dist.recv(torch.empty(1), src=0, tag=7)
    return 0
''')
    result = _grade(course, _profile(cpu), student)
    assert result.status == "error" and result.score == 0, result
    assert "bytes not yet delivered" in result.reason, result.reason
    assert _leftovers() == []


SIDE_CHANNELS = '''
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    boards = [torch.from_file(f"{folder}/fastdl-world-board", shared=True, size=4, dtype=torch.float32)
              for folder in ("/tmp", "/dev/shm", "/job")]
    if rank == 0:
        for board in boards:
            board.fill_(42.0)
        dist.send(torch.ones(1), 1)
    else:
        dist.recv(torch.empty(1), src=0)
    seen = [float(board.sum()) for board in boards]
    reached = 0.0
    if rank == 1:
        try:
            dist.TCPStore("127.0.0.1", 29611, 2, False, dist.default_pg_timeout / 1800)
            reached = 1.0
        except RuntimeError:
            reached = 0.0
    else:
        try:
            dist.TCPStore("127.0.0.1", 29611, 2, True, dist.default_pg_timeout / 1800, False)
        except RuntimeError:
            pass
    tensor.copy_(torch.tensor([*seen, reached, 0.0])[:tensor.numel()])
    return 0
'''


def test_ranks_share_no_file_no_shared_memory_and_no_network(course, cpu):
    """Rank 0 writes 42s into a file-backed tensor in /tmp, /dev/shm and /job and serves a TCP
    store on loopback; once rank 1 has heard from it through the relay, rank 1 reads the same
    paths and tries the store. In separate sandboxes it finds its own empty files, and no store."""
    make_submission(course, LAB, "world-side-channels",
                    {**reference_solutions(course, LAB), "ring_code": SIDE_CHANNELS})
    lab, sandbox = load_lab(LAB), Sandbox(course.student_package, _profile(cpu))
    item = lab.item("ring_allreduce")
    params = {"worlds": [[2, [5]]], "rank_timeout_s": 10.0}
    from autograder import notebook

    cells = notebook.graded_cells(notebook.read_notebook(course.submitted("world-side-channels", LAB))).solutions
    world = worlds.run_worlds(lab, item, cells, item.make_inputs(1, params), [(0, 2)], sandbox, params)[0]
    assert world.failure is None and all(child.run.result.ok for child in world.ranks)
    zero, one = (trials[0]["out"] for trials in world.outputs())
    assert zero[:3].tolist() == [4 * 42.0] * 3  # rank 0 sees what it wrote
    assert one.tolist() == [0.0] * 5  # rank 1: its own empty files, and no store to reach


def test_the_relay_alone_joins_the_ranks_no_loopback_between_them(course, cpu):
    """The rank children get no loopback of the grader's (no ``Limits.loopback``), and each is
    bound its own relay socket: the relay knows the rank by the socket, whatever the rank says."""
    lab = load_lab(LAB)
    assert all(item.worlds is not None for item in lab.items)
    limits = grade._item_limits(lab.item("ring_allreduce"), cpu)
    assert limits.loopback is False and limits.isolate_network is True


def test_the_worlds_of_an_item_share_rank_children_but_a_memory_world_has_its_own():
    seats = [child.seats for child in worlds._children([(0, 2), (1, 3), (2, 4), (3, 2)], dedicated={3})]
    assert seats == [[(0, 0), (1, 0), (2, 0)], [(0, 1), (1, 1), (2, 1)], [(1, 2), (2, 2)], [(2, 3)],
                     [(3, 0)], [(3, 1)]]


def test_a_rank_that_fails_in_a_later_world_is_named_in_that_world(course, cpu):
    student = _ring(course, "world-fails-later", '''
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    if dist.get_world_size() == 3 and dist.get_rank() == 2:
        raise ValueError("three is a crowd")
    return 0
''')
    profile = _profile(cpu)
    profile["labs"][LAB]["ring_allreduce"] = {"worlds": [[2, [5]], [3, [5]]], "rank_timeout_s": 10.0}
    started = time.monotonic()
    result = _grade(course, profile, student)
    assert result.status == "error" and result.score == 0, result
    assert result.reason.startswith("world 2 of 2 (3 ranks), rank 2: ") and "crowd" in result.reason, result.reason
    assert time.monotonic() - started < 8
    assert _leftovers() == []
