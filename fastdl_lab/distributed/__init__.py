"""Distributed training from first principles (lab 07 distributed).

- ``launch``: ``run_world`` forks a small torch.distributed world on this machine (gloo, or
  NCCL on request) and turns any rank's failure into ``RankFailure``; under torchrun it joins the
  world torchrun started instead;
- ``ddp``: data parallelism: a naive per-parameter all-reduce, and two module wrappers like
  torch's DistributedDataParallel, ``DDP`` (one asynchronous all-reduce per parameter) and
  ``BucketedDDP`` (gradient buckets all-reduced asynchronously while backward runs);
- ``watch``: data-parallel training measured from outside the wrapper (all-reduces logged at the
  process group, starting states, a step's timeline);
- ``ring``: ring all-reduce from send/recv, the bytes each rank sends, and the alpha-beta cost of
  ring, tree and root-based all-reduces;
- ``ps``: a parameter server with synchronous, asynchronous and staleness-capped SGD (a drop rule);
- ``zero``: ``Zero1``, any torch optimizer with its state sharded across the ranks (ZeRO stage 1);
- ``fsdp``: ``FSDPUnit``, weights, gradients and optimizer state sharded (ZeRO stage 3), with
  ``census`` measuring what each rank holds and sends;
- ``tensor_parallel``: a Megatron-style column- then row-parallel MLP, its sequence-parallel
  variant, and pipeline arithmetic.

Submodules load on first use (``distributed.ddp``), so importing the package costs little. This
module also holds the benchmark spec that ``benchmarks/distributed.py`` runs.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from fastdl_lab.distributed.launch import RankFailure, free_port, rank_device, run_world

__all__ = ["RankFailure", "free_port", "rank_device", "run_world", "bench_in_rank", "check", "benchmark", "BENCHMARK"]
_SUBMODULES = ("launch", "ddp", "watch", "ring", "ps", "zero", "fsdp", "tensor_parallel")
# torch 2.13 names the single-tensor all-gather and reduce-scatter ``all_gather_single`` and
# ``reduce_scatter_single`` and deprecates the older names, which are all that torch 2.11 (the 2026
# GPU images) has. The lab teaches the new names; on an older torch they are the same functions.
_NEWER_NAMES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _name_collectives_as_newer_torch() -> None:
    dist = torch.distributed
    for new, old in _NEWER_NAMES.items():
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))


_name_collectives_as_newer_torch()


def bench_in_rank(fn, *, warmup: int = 2, reps: int = 10):
    """``timing.bench`` for code that runs collectives: the same number of calls on every rank.

    The harness repeats a call shorter than its minimum sample several times per sample, the
    count depending on how fast the last warm-up call was; ranks timing the same collective could
    pick different counts, and a rank left waiting for a partner's extra collective would hang.
    Warming up here and passing ``warmup=0`` keeps one call per sample everywhere.
    """
    from fastdl_lab import timing

    for _ in range(warmup):
        fn()
    return timing.bench(fn, warmup=0, reps=reps)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SUBMODULES))


# Benchmark spec: what benchmarks/distributed.py runs. On the CPU every rank is one thread on a
# 2-core machine, so step times show the cost of communication more than any speedup; the
# mechanism figures (all-reduce calls per step, bytes per collective, optimizer state per rank)
# are exact anywhere. A GPU section runs only with a GPU per rank.
BENCHMARK = {
    "name": "distributed",
    "model": {"d_in": 256, "d_hidden": 512, "d_out": 256, "batch": 512},
    "world_sizes": [1, 2],
    "bucket_bytes": [64 << 10, 1 << 20],
    "allreduce_numel": [1 << 10, 1 << 16, 1 << 20, 1 << 22],
    "fsdp_dims": [256, 512, 512, 256],
    "columns": ["op", "variant", "backend", "world_size", "numel", "bucket_bytes", "allreduce_calls",
                "bytes_sent", "param_bytes", "grad_bytes", "state_bytes", "other_units_gathered_bytes", "all_gathers",
                "reduce_scatters", "median_s", "iqr_s", "gbs"],
}


def _model_fn():
    m = BENCHMARK["model"]
    return _sub("ddp").small_mlp(0, m["d_in"], m["d_hidden"], m["d_out"])


def _sub(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def _row(**values) -> dict:
    return {column: values.get(column) for column in BENCHMARK["columns"]}


def _time_allreduce(rank, world_size, numel, ours, reps):
    ring = _sub("ring")
    buf = torch.ones(numel, device=rank_device())
    op = ring.ring_allreduce_ref if ours else torch.distributed.all_reduce
    t = bench_in_rank(lambda: op(buf), reps=reps)
    return {"median_s": t.median, "iqr_s": t.iqr}


def _ddp_rows(backend: str, world_sizes, reps: int, log) -> list[dict]:
    ddp = _sub("ddp")
    m = BENCHMARK["model"]
    data = ddp.make_regression(0, m["batch"], m["d_in"], m["d_out"])
    numel = sum(p.numel() for p in _model_fn().parameters())
    rows = []
    variants = [("naive", ddp.allreduce_gradients_ref, None), ("per-param", ddp.DDP, None)]
    variants += [("bucketed", ddp.BucketedDDP, b) for b in BENCHMARK["bucket_bytes"]]
    for world_size in world_sizes:
        for variant, sync, bucket_bytes in variants if world_size > 1 else variants[:1]:
            kwargs = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
            r = run_world(_sub("watch").time_step, world_size, _model_fn, data, sync, reps, backend=backend,
                          **kwargs)[0]
            rows.append(_row(op="ddp_step", variant=variant if world_size > 1 else "one process", backend=backend,
                             world_size=world_size, numel=numel, bucket_bytes=bucket_bytes,
                             allreduce_calls=r["calls_per_step"], median_s=r["median_s"], iqr_s=r["iqr_s"]))
            log(f"ddp step {variant:>8} bucket {bucket_bytes or '-':>8} on {world_size} rank(s), {backend}: "
                f"{r['median_s'] * 1e3:8.2f} ms, {r['calls_per_step']} all-reduce(s) per step")
    return rows


def _allreduce_rows(backend: str, reps: int, log) -> list[dict]:
    ring = _sub("ring")
    rows = []
    for numel in BENCHMARK["allreduce_numel"]:
        for variant, ours in (("ring send/recv", True), (f"{backend} all_reduce", False)):
            r = run_world(_time_allreduce, 2, numel, ours, reps, backend=backend)[0]
            sent = ring.ring_bytes_ref(numel, 4, 2, 0)
            rows.append(_row(op="allreduce", variant=variant, backend=backend, world_size=2, numel=numel,
                             bytes_sent=sent, median_s=r["median_s"], iqr_s=r["iqr_s"],
                             gbs=sent / r["median_s"] / 1e9))
            log(f"all-reduce {variant:>16} {numel:>8} floats: {r['median_s'] * 1e3:8.3f} ms, "
                f"{sent} B sent per rank, {sent / r['median_s'] / 1e9:.2f} GB/s")
    return rows


def _zero_rows(log) -> list[dict]:
    zero, ddp = _sub("zero"), _sub("ddp")
    m = BENCHMARK["model"]
    data = ddp.make_regression(0, 64, m["d_in"], m["d_out"])
    numel = sum(p.numel() for p in _model_fn().parameters())
    rows = []
    for world_size in (1, 2, 4):
        # On one rank Zero1 owns every parameter: the unsharded optimizer's state.
        state = run_world(zero.train_zero, world_size, _model_fn, data, 1, torch.optim.Adam, lr=1e-3)[0]["state_bytes"]
        rows.append(_row(op="optimizer_state", variant="Zero1(Adam)", backend="gloo", world_size=world_size,
                         numel=numel, state_bytes=state))
    for row in rows:
        log(f"optimizer state, {row['variant']:>16} on {row['world_size']} rank(s): {row['state_bytes']} B per rank "
            f"for {numel} parameters")
    return rows


def _fsdp_rows(log) -> list[dict]:
    fsdp, ddp = _sub("fsdp"), _sub("ddp")
    dims = BENCHMARK["fsdp_dims"]
    data = ddp.make_regression(0, 64, dims[0], dims[-1])
    model_fn = functools.partial(fsdp.unit_mlp, 0, dims)
    numel = sum(p.numel() for p in model_fn().parameters())
    rows = []
    for world_size in (1, 2, 4):
        for variant, compute_dtype, prefetch in (("fp32", None, False), ("fp32, prefetch", None, True),
                                                 ("bf16 compute, fp32 shards", torch.bfloat16, False)):
            steps = 2
            r = run_world(fsdp.train_fsdp, world_size, model_fn, data, steps, 0.1, compute_dtype=compute_dtype,
                          prefetch=prefetch)[0]
            memory, wire = r["memory"], r["wire"]
            rows.append(_row(op="fsdp_step", variant=variant, backend="gloo", world_size=world_size, numel=numel,
                             param_bytes=memory["param_bytes"], grad_bytes=memory["grad_bytes"],
                             state_bytes=memory["state_bytes"], other_units_gathered_bytes=wire["max_live_bytes"],
                             all_gathers=wire["all_gathers"] // steps, reduce_scatters=wire["reduce_scatters"] // steps))
            log(f"fsdp {variant:>26} on {world_size} rank(s): parameters {memory['param_bytes']} B, gradients "
                f"{memory['grad_bytes']} B, momentum {memory['state_bytes']} B per rank of {4 * numel} B; "
                f"other units gathered at a gather: at most {wire['max_live_bytes']} B; {wire['all_gathers'] // steps} all-gathers and "
                f"{wire['reduce_scatters'] // steps} reduce-scatters per step")
    return rows


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Step times, collective bytes and times, optimizer state per rank, FSDP's bytes per rank and
    collectives per step; one dict per measurement."""
    rows = _ddp_rows("gloo", BENCHMARK["world_sizes"], reps, log)
    rows += _allreduce_rows("gloo", reps, log)
    rows += _zero_rows(log)
    rows += _fsdp_rows(log)
    if torch.cuda.device_count() >= 2 and not torch.cuda.is_initialized():
        rows += _ddp_rows("nccl", [2], reps, log)
        rows += _allreduce_rows("nccl", reps, log)
    else:
        log("nccl: needs a GPU per rank (2 GPUs, untouched by this process); the gloo rows above ran on the CPU")
    return rows


def check() -> None:
    """Every module's check on small worlds; raises on a mismatch."""
    for name in _SUBMODULES:
        _sub(name).check()
