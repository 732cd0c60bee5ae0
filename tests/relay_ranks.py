"""Worlds of ranks behind a relay, for tests/test_relay.py: the relay in the test's process, each
rank a process of its own that joins with ``init_relay_world`` and runs one of ``PROGRAMS``.

Ranks are forked by a fork server that has imported torch once (a fresh interpreter per rank
would spend seconds importing it), never from the test's process, whose relay threads may hold
locks at the moment of a fork. The ranks here are honest code: no sandbox.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import connection

import torch
import torch.distributed as dist

from autograder.engine import relay_backend
from autograder.engine import relay_protocol as protocol
from autograder.engine.relay import Relay
from autograder.engine.relay_backend import init_relay_world

# What the fork server imports once for every rank. torch._dynamo is among them because an
# optimizer's first step imports it: seconds in every rank otherwise.
PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "torch.distributed.fsdp",
           "autograder.engine.relay_backend", "relay_ranks", "fastdl_lab.distributed.ddp",
           "fastdl_lab.distributed.ring", "fastdl_lab.distributed.fsdp", "fastdl_lab.distributed.tensor_parallel"]
PROGRAMS: dict = {}
_context = None


def program(fn=None, *, raw: bool = False):
    """Register a rank program: ``fn(rank, world_size, *args)`` once the world is joined, or with
    ``raw`` ``fn(socket_path, rank, world_size, *args)`` that talks to the relay itself."""
    def register(f):
        f.raw = raw
        PROGRAMS[f.__name__] = f
        return f
    return register(fn) if fn is not None else register


@dataclass
class Outcome:
    results: list  # what each rank's program returned (None where it raised)
    errors: dict[int, str]  # rank -> "ExceptionType: message"
    finished: dict[int, float]  # rank -> monotonic clock when it reported
    records: list[dict]
    failure: str | None
    started: float = 0.0
    exit_codes: list = field(default_factory=list)


# Results go back pickled by hand: the pipe's own pickler hands tensors over as shared memory
# that the parent fetches from the child, which has exited by then.
def _rank_main(name: str, path: str, rank: int, world_size: int, timeout_s: float, args: tuple, conn) -> None:
    code = 0
    try:
        torch.set_num_threads(1)
        fn = PROGRAMS[name]
        if fn.raw:
            value = fn(path, rank, world_size, *args)
        else:
            init_relay_world(path, rank, world_size, timeout_s)
            value = fn(rank, world_size, *args)
            dist.destroy_process_group()
        conn.send_bytes(pickle.dumps(("ok", _detached(value), time.monotonic())))
    except BaseException as exc:  # noqa: BLE001 - the test wants whatever stopped the rank
        code = 1
        message = f"{type(exc).__name__}: {exc}"
        if os.environ.get("FASTDL_RELAY_TRACE"):
            message += "\n" + traceback.format_exc()
        conn.send_bytes(pickle.dumps(("error", message, time.monotonic())))
    finally:
        os._exit(code)


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    return value


def _fork_server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _idle() -> None:
    os._exit(0)


def warm() -> None:
    """Start the fork server (it imports torch and the programs' modules once, seconds), so that
    the worlds' clocks do not count it."""
    proc = _fork_server().Process(target=_idle)
    proc.start()
    proc.join()


def run(name: str, world_size: int, *args, timeout_s: float = 3.0, max_message_bytes: int = 1 << 20,
        max_held_bytes: int | None = None, max_operations: int = 100_000, ranks=None) -> Outcome:
    """Run program ``name`` on ``world_size`` ranks behind a fresh relay (only the ``ranks`` given,
    when given) and return what happened; any rank still alive after twice the timeout is killed."""
    ctx = _fork_server()
    with tempfile.TemporaryDirectory(prefix="relay-") as folder:
        paths = [os.path.join(folder, f"rank{r}.sock") for r in range(world_size)]
        relay = Relay(paths, timeout_s=timeout_s, max_message_bytes=max_message_bytes,
                      max_held_bytes=max_held_bytes, max_operations=max_operations).start()
        procs, pipes = {}, {}
        try:
            started = time.monotonic()
            for rank in (range(world_size) if ranks is None else ranks):
                mine, theirs = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_rank_main,
                                   args=(name, paths[rank], rank, world_size, timeout_s, args, theirs))
                proc.start()
                theirs.close()
                procs[rank], pipes[rank] = proc, mine
            outcome = Outcome([None] * world_size, {}, {}, [], None, started)
            deadline = time.monotonic() + 2 * timeout_s + 10
            waiting = dict(pipes)
            while waiting and time.monotonic() < deadline:
                for conn in connection.wait(list(waiting.values()), deadline - time.monotonic()):
                    rank = next(r for r, c in waiting.items() if c is conn)
                    del waiting[rank]
                    try:
                        kind, value, when = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        outcome.errors[rank] = "the rank died without a word"
                        continue
                    outcome.finished[rank] = when
                    if kind == "ok":
                        outcome.results[rank] = value
                    else:
                        outcome.errors[rank] = value
            for rank in waiting:
                outcome.errors[rank] = "still running at the test's deadline"
            relay.wait_ended(2.0)
        finally:
            for proc in procs.values():
                if proc.exitcode is None:
                    proc.kill()
                proc.join()
            relay.close()
        outcome.records, outcome.failure = relay.records(), relay.failure
        outcome.exit_codes = [procs[r].exitcode if r in procs else None for r in range(world_size)]
        return outcome


# --- programs ------------------------------------------------------------------------------------

def _ints(rank: int, shape, dtype=torch.float32, salt: int = 0) -> torch.Tensor:
    """Integer values that differ per rank: sums, products, minima are exact in any order."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


@program
def every_op(rank: int, world: int, use_async: bool, with_avg: bool = True) -> dict:
    """Every carried operation once, on ragged shapes, blocking or async (``work.wait()`` after
    the call returns)."""
    out = {}

    def run(call, *a, **k):
        if use_async:
            work = call(*a, async_op=True, **k)
            assert work is not None
            work.wait()
        else:
            call(*a, **k)

    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX} | ({"avg": dist.ReduceOp.AVG} if with_avg else {})
    for name, op in ops.items():
        t = _ints(rank, (3, 5), salt=len(name))
        run(dist.all_reduce, t, op=op)
        out[f"all_reduce_{name}"] = t
    for name, op in {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}.items():
        t = _ints(rank, (7,), torch.int64, salt=9) + 8
        run(dist.all_reduce, t, op=op)
        out[f"all_reduce_{name}"] = t
    t = _ints(rank, (4,), torch.bfloat16, salt=2)
    run(dist.all_reduce, t)
    out["all_reduce_bf16"] = t
    t = _ints(rank, (2, 3), salt=3)
    run(dist.reduce, t, dst=world - 1)
    out["reduce"] = t if rank == world - 1 else torch.zeros(0)  # gloo may use the others' as scratch
    t = _ints(rank, (2, 3), torch.float64, salt=4)
    run(dist.broadcast, t, src=world - 1)
    out["broadcast"] = t
    outs = [torch.empty(5) for _ in range(world)]
    run(dist.all_gather, outs, _ints(rank, (5,), salt=5))
    out["all_gather"] = torch.stack(outs)
    t = torch.empty(world * 3, dtype=torch.int32)
    run(dist.all_gather_single, t, _ints(rank, (3,), torch.int32, salt=6))
    out["all_gather_single"] = t
    t = torch.empty(3)
    run(dist.reduce_scatter, t, [_ints(rank, (3,), salt=7 + i) for i in range(world)])
    out["reduce_scatter"] = t
    t = torch.empty(2, 2)
    run(dist.reduce_scatter_single, t, _ints(rank, (2 * world, 2), salt=8))
    out["reduce_scatter_single"] = t
    gathered = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    run(dist.gather, _ints(rank, (4,), salt=10), gathered, dst=0)
    out["gather"] = torch.stack(gathered) if rank == 0 else torch.zeros(0)
    t = torch.empty(6)
    run(dist.scatter, t, [_ints(0, (6,), salt=11 + i) for i in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = t
    run(dist.barrier)
    # A ring of sends and receives with two tags, then every rank sends rank 0 one message that
    # rank 0 receives from any source.
    right, left = (rank + 1) % world, (rank - 1) % world
    first, second = torch.empty(3), torch.empty(2)
    works = [dist.isend(_ints(rank, (2,), salt=12), right, tag=2), dist.isend(_ints(rank, (3,), salt=13), right, tag=1),
             dist.irecv(first, left, tag=1), dist.irecv(second, left, tag=2)]
    for work in works:
        work.wait()
    out["ring_tag1"], out["ring_tag2"] = first, second
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            t = torch.empty(1)
            src = dist.recv(t)
            assert t.item() == src, (t, src)
            senders.append(src)
        out["any_source"] = torch.tensor(sorted(senders))
    else:
        dist.send(torch.tensor([float(rank)]), 0)
        out["any_source"] = torch.zeros(0)
    return out


@program
def ring(rank: int, world: int, numels: list) -> list:
    """The course's ring all-reduce (isend/irecv only) on each size; what it returned and held."""
    from fastdl_lab.distributed import ring as course_ring

    results = []
    for numel in numels:
        t = course_ring.trial_input(rank, numel, seed=numel)
        reported = course_ring.ring_allreduce_ref(t)
        results.append({"out": t, "reported": reported})
        dist.barrier()  # each rank's sends for this size are those it made before this barrier
    return results


@program
def ddp_training(rank: int, world: int, steps: int, bucket_bytes: int) -> dict:
    """torch's DistributedDataParallel, then the course's BucketedDDP, from skewed starts."""
    from torch import nn

    from fastdl_lab.distributed import ddp

    def model_fn():
        return ddp.rank_skewed_mlp(3, 6, 10, 2)

    data = ddp.make_regression(5, 4 * world, 6, 2)
    x, y = ddp._shard(data, rank, world)
    model = model_fn()
    wrapper = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2**20)
    opt = torch.optim.SGD(wrapper.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        ddp._loss(wrapper, x, y).backward()
        opt.step()
    torch_state = ddp._detached_state(model)
    dist.barrier()  # a marker in the log between the two trainings
    course_state = ddp.train_ddp(rank, world, model_fn, data, steps, 0.1, sync=ddp.BucketedDDP,
                                 bucket_bytes=bucket_bytes)
    return {"torch": torch_state, "course": course_state}


@program
def sharding(rank: int, world: int) -> dict:
    """The course's FSDP and tensor-parallel trials, measured by the relay instead of the census."""
    from fastdl_lab.distributed import ddp, fsdp, tensor_parallel

    dims = [7, 12, 9, 3]
    fsdp_result = fsdp.train_fsdp(rank, world, lambda: fsdp.unit_mlp(2, dims), ddp.make_regression(2, 3 * world, 7, 3),
                                  2, 0.1)
    dist.barrier()
    tp_result = tensor_parallel.tp_trial(rank, world, 4, 5, 6, 4 * world + 1)
    return {"fsdp": fsdp_result, "tp": tp_result}


@program
def overlaps(rank: int, world: int) -> dict:
    """Rank 0 starts an all-reduce async, computes for a while, then waits; the others call it at
    once. When did rank 0 start, and wait, and was its work done before the wait?"""
    t = torch.full((4,), float(rank))
    if rank != 0:
        dist.all_reduce(t)
        return {}
    issued = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    relay_backend.mark("computing")
    time.sleep(0.6)
    done_before_wait = work.is_completed()
    waited = time.monotonic()
    relay_backend.mark("waiting")
    work.wait()
    return {"issued": issued, "waited": waited, "done_before_wait": done_before_wait, "sum": t}


@program
def mismatched(rank: int, world: int, kind: str) -> None:
    dist.all_reduce(torch.ones(3))
    if kind == "shape":
        dist.all_reduce(torch.ones(4 if rank == 0 else 5))
    elif kind == "op":
        if rank == 0:
            dist.broadcast(torch.ones(4), src=0)
        else:
            dist.all_reduce(torch.ones(4))
    elif kind == "dtype":
        dist.all_reduce(torch.ones(4, dtype=torch.float64 if rank == 1 else torch.float32))
    elif kind == "reduce":
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM)
    elif kind == "root":
        dist.broadcast(torch.ones(4), src=rank)
    dist.all_reduce(torch.ones(3))


@program
def dies(rank: int, world: int, how: str) -> None:
    """Rank 1 leaves at the second collective: before calling it, or with it in flight (called
    async, then gone before rank 0 calls it)."""
    dist.all_reduce(torch.ones(3))
    if rank == 1:
        if how == "in_flight":
            dist.all_reduce(torch.ones(3), async_op=True)
            time.sleep(0.2)
        os._exit(3)
    if how == "in_flight":
        time.sleep(0.5)
    dist.all_reduce(torch.ones(3))


@program
def stalls(rank: int, world: int, what: str, sleep_s: float) -> dict:
    """Rank 0 waits (in an all-reduce, or a recv from rank 1) while rank 1 sleeps, then calls an
    all-reduce. Each says when its call began and ended, and how."""
    if rank == 1:
        time.sleep(sleep_s)
    began = time.monotonic()
    try:
        if rank == 0 and what == "recv":
            dist.recv(torch.empty(2), 1)
        else:
            dist.all_reduce(torch.ones(2))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"began": began, "ended": time.monotonic(), "error": error}


@program
def too_large(rank: int, world: int) -> None:
    """Rank 0 all-reduces a tensor over the relay's message cap: refused before it leaves."""
    dist.all_reduce(torch.ones(4096 if rank == 0 else 4))


@program
def floods(rank: int, world: int, messages: int, numel: int) -> None:
    """Rank 0 sends rank 1 message after message, none of them received; rank 1 then waits for it
    in a barrier."""
    if rank == 0:
        for _ in range(messages):
            dist.send(torch.ones(numel), 1)
    else:
        time.sleep(0.5)
    dist.barrier()


def _raw_join(path: str, rank: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    hello = protocol.recv(sock, 1 << 16)
    assert hello["welcome"]["rank"] == rank, hello
    return sock


@program(raw=True)
def impostor(path: str, rank: int, world: int) -> dict:
    """Rank 1 says, every way it can, that it is rank 0, and tries a second connection."""
    if rank == 0:
        init_relay_world(path, rank, world, 3.0)
        t = torch.empty(2)
        src = dist.recv(t)
        dist.destroy_process_group()
        return {"src": src, "value": t}
    sock = _raw_join(path, rank)
    second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        second.connect(path)
        refused = False
    except OSError:
        refused = True
    protocol.send(sock, {"id": 0, "op": "send", "tensors": [torch.tensor([1.0, 2.0])], "dst": 0, "tag": 0,
                         "rank": 0, "src": 0})
    answer = protocol.recv(sock, 1 << 16)
    sock.close()
    return {"refused": refused, "answer": answer}


@program(raw=True)
def hostile_frame(path: str, rank: int, world: int, kind: str) -> dict:
    """Rank 1 sends a frame that claims 1 GiB, a frame of garbage, or a request for an unknown op;
    rank 0 waits in an all-reduce."""
    if rank == 0:
        init_relay_world(path, rank, world, 3.0)
        dist.all_reduce(torch.ones(2))
        return {}
    sock = _raw_join(path, rank)
    if kind == "huge":
        sock.sendall(protocol.FRAME.pack(1 << 30) + b"\0" * 64)
    elif kind == "garbage":
        sock.sendall(protocol.FRAME.pack(16) + b"not the format!!")
    else:
        protocol.send(sock, {"id": 0, "op": "exec", "tensors": []})
    try:
        answer = protocol.recv(sock, 1 << 16)
    except protocol.ProtocolError as exc:
        answer = {"closed": str(exc)}
    time.sleep(0.5)
    return {"answer": answer}



def fsdp2_model():
    from torch import nn

    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def fsdp2_data(world: int):
    g = torch.Generator().manual_seed(12)
    return torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 2, generator=g)


@program
def fsdp2(rank: int, world: int, steps: int) -> dict:
    """torch's FSDP2 (``fully_shard`` per layer, then the root) over a one-dimensional mesh; the
    full weights afterwards (a barrier first marks the end of training in the log)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = fsdp2_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = (t.chunk(world)[rank] for t in fsdp2_data(world))
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    dist.barrier()
    return {name: p.full_tensor() for name, p in model.named_parameters()}
