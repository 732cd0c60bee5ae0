"""Ring all-reduce from point-to-point sends and receives (lab 07).

The N ranks form a ring, each sending only to its right neighbour and receiving only from its
left one. The tensor is cut into N chunks and the algorithm runs in two phases of N-1 steps:

* **reduce-scatter**: at step s rank r sends chunk (r - s) mod N and adds the chunk (r - s - 1)
  mod N that arrives into its own copy; after N-1 steps rank r holds the complete sum of chunk
  (r + 1) mod N;
* **all-gather**: at step s rank r sends chunk (r + 1 - s) mod N, complete by now, and
  overwrites its chunk (r - s) mod N with the one that arrives.

Every link carries one chunk at every step, so each rank sends 2 (N-1)/N times the tensor,
whatever N is: the least any all-reduce can make a rank send (Patarasuk and Yuan, 2009), and
why NCCL's large all-reduces use rings.

Chunks follow ``torch.tensor_split``: with numel = q N + m, the first m chunks hold q + 1
elements and the others q (some are empty when numel < N). The remainder must not be dropped.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from fastdl_lab import checks
from fastdl_lab.distributed import census
from fastdl_lab.distributed.census import CollectiveRefused
from fastdl_lab.distributed.launch import rank_device, run_world


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """Elements in each of the ring's ``world_size`` chunks (``torch.tensor_split``'s split)."""
    q, m = divmod(numel, world_size)
    return [q + 1 if i < m else q for i in range(world_size)]


def ring_bytes_ref(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in ``ring_allreduce_ref`` on a tensor of ``numel`` elements.

    Reduce-scatter sends every chunk but (rank + 1) mod N, all-gather every chunk but
    (rank + 2) mod N, so with c_i the chunk sizes of ``chunk_sizes``

        bytes = (2 numel - c[(rank + 1) mod N] - c[(rank + 2) mod N]) * element_size

    which is 2 (N-1)/N * numel * element_size when N divides numel, and can differ by one
    element per phase between ranks when it does not. One rank alone sends nothing.
    """
    if world_size == 1:
        return 0
    sizes = chunk_sizes(numel, world_size)
    return (2 * numel - sizes[(rank + 1) % world_size] - sizes[(rank + 2) % world_size]) * element_size


def ring_allreduce_ref(tensor: torch.Tensor) -> int:
    """Sum ``tensor`` over all ranks in place, with sends and receives only; the bytes sent."""
    ### BEGIN SOLUTION
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    chunks = list(torch.tensor_split(flat, world))
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0

    def exchange(send_index: int, recv_index: int) -> torch.Tensor | None:
        # Post the send before blocking on the receive: were every rank to receive first, or
        # send synchronously, the ring would wait on itself. Empty chunks (numel < world) are
        # skipped on both sides alike, since every rank knows every chunk's size.
        nonlocal sent
        outgoing, incoming = chunks[send_index], torch.empty_like(chunks[recv_index])
        requests = []
        if outgoing.numel():
            requests.append(dist.isend(outgoing, right))
            sent += outgoing.numel() * outgoing.element_size()
        if incoming.numel():
            requests.append(dist.irecv(incoming, left))
        for request in requests:
            request.wait()
        return incoming

    for step in range(world - 1):
        recv_index = (rank - step - 1) % world
        chunks[recv_index].add_(exchange((rank - step) % world, recv_index))
    for step in range(world - 1):
        recv_index = (rank - step) % world
        chunks[recv_index].copy_(exchange((rank + 1 - step) % world, recv_index))
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return sent
    ### END SOLUTION


# Everything that could all-reduce for the student: the ring may only use point-to-point messages.
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "all_to_all", "all_to_all_single", "gather", "scatter", "_all_gather_base", "_reduce_scatter_base")
# Every data-moving method of the process group but the point-to-point ones.
PROCESS_GROUP_COLLECTIVES = tuple(name for name in census.DATA_METHODS if name not in census.POINT_TO_POINT)


@contextlib.contextmanager
def point_to_point_only():
    """While it lasts: collectives raise, and every byte sent is counted here, at the process
    group's ``send`` (which ``send``, ``isend`` and ``batch_isend_irecv`` all reach, as does a call
    on the group itself), by the transport's side rather than by the caller. A backend's own
    methods, a way around the process group, raise.

    Yields a one-element list holding the count.
    """
    sent = [0]
    patches = []

    def patch(owner, name, value):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def refuse(name):
        def refused(*args, **kwargs):
            raise CollectiveRefused(f"{name} is a collective: the ring may only use send/recv (isend/irecv)")
        return refused

    def counting(original):
        def counted(group, tensors, *args, **kwargs):
            sent[0] += sum(t.numel() * t.element_size() for t in tensors)
            return original(group, tensors, *args, **kwargs)
        return counted

    for name in COLLECTIVES:
        refused = refuse(name)
        for module in (dist, dist.distributed_c10d):
            if hasattr(module, name):
                patch(module, name, refused)
    for name in PROCESS_GROUP_COLLECTIVES:
        if hasattr(c10d.ProcessGroup, name):
            patch(c10d.ProcessGroup, name, refuse(name))
    patch(c10d.ProcessGroup, "send", counting(c10d.ProcessGroup.send))
    patches += census.refuse_backends()
    try:
        yield sent
    finally:
        for owner, name, value in reversed(patches):
            setattr(owner, name, value)


def ring_trial(rank: int, world_size: int, numel: int, allreduce=ring_allreduce_ref, seed: int = 0) -> dict:
    """One rank's part of a test: all-reduce its own integer-valued input with ``allreduce``.

    Integers in float32 add exactly in any order, so the result must equal the sum bit for bit.
    ``sent`` is what the transport carried from this rank; ``reported`` is what ``allreduce``
    returned as its own count.
    """
    mine = trial_input(rank, numel, seed).to(rank_device())
    out = mine.clone()
    with point_to_point_only() as sent:
        reported = allreduce(out)
    return {"out": out, "sent": sent[0], "reported": reported}


def trial_input(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input in ``ring_trial``: integers in [-50, 50] as float32."""
    return torch.randint(-50, 51, (numel,), generator=checks.generator(seed * 1000 + rank)).float()


def check_ring(results: list[dict], numel: int, seed: int = 0, name: str = "ring") -> None:
    """Every rank holds the exact sum, sent exactly ``ring_bytes_ref`` bytes, and says so."""
    world_size = len(results)
    expected = sum(trial_input(r, numel, seed) for r in range(world_size))
    for rank, result in enumerate(results):
        where = f"{name}, {world_size} ranks, numel {numel}, rank {rank}"
        checks.assert_close(result["out"], expected, atol=0.0, rtol=0.0, name=where)
        want = ring_bytes_ref(numel, 4, world_size, rank)
        if result["sent"] != want:
            raise checks.MismatchError(f"{where}: sent {result['sent']} bytes, the ring sends {want}")
        if result["reported"] != result["sent"]:
            raise checks.MismatchError(f"{where}: returned {result['reported']} as the bytes sent, "
                                       f"but sent {result['sent']}")


def root_allreduce_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes through rank 0's link when every rank sends it its tensor and it sends the sum back:
    (N-1) tensors in and (N-1) out, growing with N where the ring's stay below two tensors."""
    return 2 * (world_size - 1) * numel * element_size


def allreduce_time_model(nbytes: float, world_size: int, alpha: float, beta: float, algorithm: str = "ring") -> float:
    """Seconds an all-reduce of ``nbytes`` takes in the alpha-beta model (latency alpha per
    message, bandwidth beta bytes/s per link, links used in parallel):

    * ring: 2 (N-1) steps, each one message of nbytes / N;
    * tree: a binomial-tree reduce then broadcast, 2 ceil(log2 N) steps of the whole tensor;
    * root: rank 0 receives N-1 tensors and sends N-1 back, one after another.

    The ring wins on bandwidth, the tree on latency: NCCL picks between them by size.
    """
    n = world_size
    if algorithm == "ring":
        return 2 * (n - 1) * (alpha + nbytes / n / beta)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / beta)
    if algorithm == "root":
        return 2 * (n - 1) * (alpha + nbytes / beta)
    raise ValueError(f"algorithm must be 'ring', 'tree' or 'root', got {algorithm!r}")


def busbw_factor(world_size: int) -> float:
    """Bytes on the wire per rank over the tensor's bytes for a ring all-reduce: 2 (N-1) / N."""
    return 2 * (world_size - 1) / world_size


def check() -> None:
    """The ring on 2 and 3 ranks, on sizes below, at and above the world size, uneven ones included."""
    for world_size in (2, 3):
        for numel in (1, 5, 7, 1000):
            check_ring(run_world(ring_trial, world_size, numel), numel)
    print("ring: all-reduce from send/recv is exact, with the bytes the formula predicts")


if __name__ == "__main__":
    check()
