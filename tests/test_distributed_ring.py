"""Lab 07 distributed: ring all-reduce from send/recv is exact for any size and world, and its
byte count matches the formula."""

import pytest
import torch
import torch.distributed as dist

from fastdl_lab import checks
from fastdl_lab.distributed import ring, run_world

pytestmark = pytest.mark.distributed

NUMELS = [1, 5, 7, 1000]


def _all_sizes(rank, world_size, allreduce):
    return [ring.ring_trial(rank, world_size, n, allreduce=allreduce, seed=n) for n in NUMELS]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_is_exact_and_sends_what_the_formula_says(world_size):
    per_rank = run_world(_all_sizes, world_size, ring.ring_allreduce_ref)
    for i, numel in enumerate(NUMELS):
        ring.check_ring([r[i] for r in per_rank], numel, seed=numel)


def _ring_dropping_the_remainder(tensor):
    """The classic bug: chunks of numel // N elements, so the last numel % N are never reduced."""
    rank, world = dist.get_rank(), dist.get_world_size()
    size = tensor.numel() // world
    chunks = [tensor[i * size:(i + 1) * size] for i in range(world)]
    sent = 0
    for step in range(world - 1):
        send, recv = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        incoming = torch.empty_like(recv)
        request = dist.isend(send, (rank + 1) % world) if send.numel() else None
        if incoming.numel():
            dist.recv(incoming, (rank - 1) % world)
        if request:
            request.wait()
        sent += send.numel() * 4
        recv.add_(incoming)
    for step in range(world - 1):
        send, recv = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        request = dist.isend(send, (rank + 1) % world) if send.numel() else None
        if recv.numel():
            dist.recv(recv, (rank - 1) % world)
        if request:
            request.wait()
        sent += send.numel() * 4
    return sent


@pytest.mark.parametrize("world_size, numel", [(3, 7), (2, 1), (4, 1001)])
def test_the_check_rejects_a_ring_that_drops_the_remainder(world_size, numel):
    results = run_world(ring.ring_trial, world_size, numel, allreduce=_ring_dropping_the_remainder)
    with pytest.raises(checks.MismatchError):
        ring.check_ring(results, numel)


def test_the_broken_ring_is_right_when_sizes_divide():
    # The broken variant is a real ring: it only fails on the remainder, which the sizes above exercise.
    ring.check_ring(run_world(ring.ring_trial, 2, 8, allreduce=_ring_dropping_the_remainder), 8)


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 3, 7, 64, 1001])
def test_bytes_formula(world_size, numel):
    per_rank = [ring.ring_bytes_ref(numel, 2, world_size, r) for r in range(world_size)]
    # Summed over ranks, each element crosses N - 1 links in each phase.
    assert sum(per_rank) == 2 * (world_size - 1) * numel * 2
    if numel % world_size == 0:
        assert per_rank == [ring.busbw_factor(world_size) * numel * 2] * world_size
    assert max(per_rank) - min(per_rank) <= 2 * 2


def test_chunks_follow_tensor_split():
    for numel, world in [(7, 3), (2, 4), (1000, 3)]:
        assert ring.chunk_sizes(numel, world) == [len(c) for c in torch.tensor_split(torch.arange(numel), world)]


def _strided(rank, world_size):
    base = torch.arange(12.0).reshape(3, 4) * (rank + 1)
    view = base.t()
    sent = ring.ring_allreduce_ref(view)
    return view, sent


def test_non_contiguous_tensor_is_reduced_in_place():
    results = run_world(_strided, 3)
    expected = torch.arange(12.0).reshape(3, 4).t() * 6
    for view, sent in results:
        checks.assert_close(view, expected.contiguous(), atol=0, rtol=0)
    assert [sent for _, sent in results] == [ring.ring_bytes_ref(12, 4, 3, r) for r in range(3)]


def test_one_rank_sends_nothing():
    out = run_world(lambda rank, world_size: ring.ring_allreduce_ref(torch.ones(5)), 1)
    assert out == [0] and ring.ring_bytes_ref(5, 4, 1, 0) == 0


def test_alpha_beta_model():
    alpha, beta, nbytes = 1e-5, 1e9, 1e8
    # One rank pair: every algorithm is one exchange each way.
    assert ring.allreduce_time_model(nbytes, 2, alpha, beta, "ring") == pytest.approx(2 * alpha + nbytes / beta)
    big = {a: ring.allreduce_time_model(nbytes, 64, alpha, beta, a) for a in ("ring", "tree", "root")}
    small = {a: ring.allreduce_time_model(64, 64, alpha, beta, a) for a in ("ring", "tree", "root")}
    assert big["ring"] < big["tree"] < big["root"]
    assert small["tree"] < small["ring"]
    assert ring.root_allreduce_bytes(10, 4, 5) == 2 * 4 * 10 * 4
    with pytest.raises(ValueError):
        ring.allreduce_time_model(1, 2, alpha, beta, "butterfly")


def _swap_with_batched_p2p(tensor):
    """Two ranks: each sends its whole tensor to the other through batch_isend_irecv and adds."""
    other = 1 - dist.get_rank()
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, other), dist.P2POp(dist.irecv, incoming, other)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    tensor.add_(incoming)
    return tensor.numel() * tensor.element_size()


def test_batched_sends_are_counted_by_the_transport_wrapper():
    results = run_world(ring.ring_trial, 2, 10, allreduce=_swap_with_batched_p2p)
    ring.check_ring(results, 10)
    assert [r["sent"] for r in results] == [40, 40]


def _library_allreduce(tensor):
    dist.all_reduce(tensor)
    return ring.ring_bytes_ref(tensor.numel(), tensor.element_size(), dist.get_world_size(), dist.get_rank())


def test_collectives_are_refused_inside_a_ring_trial():
    with pytest.raises(Exception, match="collective"):
        run_world(ring.ring_trial, 2, 10, allreduce=_library_allreduce)
    # Outside the trial the library is untouched.
    assert run_world(lambda rank, world: dist.all_reduce(torch.ones(1)) or True, 2) == [True, True]


def _swap_through_the_group(tensor):
    """Two ranks swap through the process group's own send and recv, not torch.distributed's."""
    group, other = dist.group.WORLD, 1 - dist.get_rank()
    incoming = torch.empty_like(tensor)
    if dist.get_rank() == 0:
        group.send([tensor], other, 0).wait()
        group.recv([incoming], other, 0).wait()
    else:
        group.recv([incoming], other, 0).wait()
        group.send([tensor], other, 0).wait()
    tensor.add_(incoming)
    return 0


def test_sends_on_the_group_itself_are_counted():
    results = run_world(ring.ring_trial, 2, 10, allreduce=_swap_through_the_group)
    assert [r["sent"] for r in results] == [40, 40]


def _allreduce_on_the_backend(tensor):
    dist.group.WORLD._get_backend(tensor.device).allreduce([tensor]).wait()
    return 0


# The process group's own single-tensor all-gather: all_gather_single in torch 2.13, _allgather_base before.
GROUP_GATHER = "all_gather_single" if hasattr(dist.ProcessGroup, "all_gather_single") else "_allgather_base"


def _all_gather_single_on_the_group(tensor):
    gathered = torch.empty(dist.get_world_size() * tensor.numel())
    getattr(dist.group.WORLD, GROUP_GATHER)(gathered, tensor).wait()
    return 0


@pytest.mark.parametrize("allreduce, refusal", [
    (_allreduce_on_the_backend, "a backend's own allreduce"),
    (_all_gather_single_on_the_group, f"{GROUP_GATHER} is a collective"),
])
def test_routes_around_the_refused_collectives_are_refused_too(allreduce, refusal):
    with pytest.raises(Exception, match=refusal):
        run_world(ring.ring_trial, 2, 10, allreduce=allreduce)
    # Outside the trial the backend is untouched.
    assert run_world(lambda rank, world: _allreduce_on_the_backend(torch.ones(1)) == 0, 2) == [True, True]
