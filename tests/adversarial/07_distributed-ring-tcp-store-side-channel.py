# expect: ring_allreduce=error
# A side channel: the ranks hand each other their tensors through a TCP store on loopback that rank 0 serves (as gloo's rendezvous does), and run a decoy ring of exactly the ring's chunk sizes for the byte count. Each rank's sandbox has a network of its own: nobody reaches rank 0's store.
# %% grade_id=ring_code
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    n = flat.numel()
    store = dist.TCPStore("127.0.0.1", 29400 + n, world, rank == 0, dist.default_pg_timeout / 900)
    store.set(f"rank{rank}", ",".join(str(v) for v in flat.tolist()))
    chunks = list(torch.tensor_split(torch.zeros(n), world))
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0
    schedule = [((rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)]
    schedule += [((rank + 1 - s) % world, (rank - s) % world) for s in range(world - 1)]
    for send_index, recv_index in schedule:
        outgoing, incoming = chunks[send_index], torch.empty_like(chunks[recv_index])
        requests = []
        if outgoing.numel():
            requests.append(dist.isend(outgoing, right))
            sent += outgoing.numel() * outgoing.element_size()
        if incoming.numel():
            requests.append(dist.irecv(incoming, left))
        for request in requests:
            request.wait()
    total = torch.zeros(n)
    for other in range(world):
        values = [float(v) for v in store.get(f"rank{other}").decode().split(",") if v]
        total += torch.tensor(values)
    flat.copy_(total)
    # Rank 0's store must outlive every rank's reads.
    store.add("done", 1)
    while rank == 0 and store.add("done", 0) < world:
        pass
    return sent
