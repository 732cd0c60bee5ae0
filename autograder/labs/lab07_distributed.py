"""Graded items of lab 07 distributed: DDP wrappers, ring all-reduce, parameter server, ZeRO-1,
FSDP (fp32 and bf16) and a tensor-parallel MLP.

Each item starts small worlds of ranks inside the sandboxed child (forked, gloo on loopback in the
child's own network namespace, so concurrent gradings never share a port). The parent computes
every single-process reference itself and checks the ranks' results against it; a rank that
hangs ends at the collective timeout, and the sandbox removes every process of the world.
"""

from __future__ import annotations

import functools
import random

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs._common import per_case

# Bound before any student cell runs (see lab01_gemm).
from fastdl_lab.distributed import ddp, ps, ring, run_world, watch, zero

RANK_TIMEOUT_S = 20.0


def _model_fn(case: dict, rank: int | None = None):
    """Every hidden model starts differently on every rank (weights and a buffer): a wrapper that
    forgets to broadcast rank 0's state trains replicas that disagree. ``rank=0``: rank 0's model."""
    return functools.partial(ddp.rank_skewed_mlp, case["seed"], case["d_in"], case["d_hidden"], case["d_out"],
                             rank=rank)


def _data(case: dict):
    return ddp.make_regression(case["seed"], case["n"], case["d_in"], case["d_out"])


def _training_cases(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for world, extra in params["worlds"]:
        d_in, d_hidden, d_out = rng.randint(5, 12), rng.randint(8, 20), rng.randint(2, 4)
        cases.append({"seed": rng.randint(0, 10_000), "d_in": d_in, "d_hidden": d_hidden, "d_out": d_out,
                      "n": world * rng.randint(6, 12), "steps": int(params.get("steps", 4)),
                      "lr": rng.choice([0.05, 0.1, 0.2]), "world": world, "extra": extra})
    return {"cases": cases}


def _label(case: dict) -> str:
    extra = f", bucket_bytes={case['extra']}" if case["extra"] else ""
    return f"{case['world']} ranks{extra}"


# --- DDP wrappers: per parameter, then bucketed ----------------------------------------------

def _trials(cls, inputs: dict, buckets: bool) -> list:
    return [run_world(watch.ddp_trial, c["world"], _model_fn(c), _data(c), c["steps"], c["lr"], sync=cls,
                      timeout_s=inputs["timeout_s"], **({"bucket_bytes": c["extra"]} if buckets else {}))
            for c in inputs["cases"]]


def ddp_drive(ns: dict, inputs: dict) -> list:
    return _trials(ns["DDP"], inputs, buckets=False)


def bucketed_drive(ns: dict, inputs: dict) -> list:
    return _trials(ns["BucketedDDP"], inputs, buckets=True)


def _wrapper_verdict(inputs: dict, outputs, expected_units, ordered: bool, what: str) -> Verdict:
    """Parity from skewed starts first (per case), then the all-reduces the trusted log saw."""
    cases = inputs["cases"]

    def check_one(i: int) -> None:
        c, trials = cases[i], outputs[i]
        if not isinstance(trials, list) or len(trials) != c["world"]:
            raise AssertionError(f"{_label(c)}: expected one result per rank")
        reference = ddp.train_reference(_model_fn(c, rank=0), _data(c), c["steps"], c["lr"])
        watch.check_trials(trials, _model_fn(c, rank=0), reference, name=f"{_label(c)}:")

    parity = per_case([_label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return parity
    for c, trials in zip(cases, outputs, strict=True):
        problem = watch.overlap_problem(trials, expected_units(c), c["steps"], ordered)
        if problem is not None:
            kind, message = problem
            fraction = 0.5 if kind == "layout" else 0.75
            return Verdict(fraction, f"replicas correct from skewed starts, but {_label(c)}: {message}")
    return Verdict.passed(f"parity on {len(cases)} hidden worlds whose ranks start apart; {what}, all launched "
                          "during backward")


def ddp_check(inputs: dict, outputs, params: dict) -> Verdict:
    def per_parameter(c: dict) -> list[int]:
        return [p.numel() for p in _model_fn(c, rank=0)().parameters()]

    return _wrapper_verdict(inputs, outputs, per_parameter, False, "one all-reduce per parameter")


def bucketed_check(inputs: dict, outputs, params: dict) -> Verdict:
    def buckets(c: dict) -> list[int]:
        return ddp.bucket_sizes(_model_fn(c, rank=0)(), c["extra"])

    return _wrapper_verdict(inputs, outputs, buckets, True, "one all-reduce per bucket, in bucket order")


# --- ring all-reduce -------------------------------------------------------------------------

def ring_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    return {"worlds": [[world, rng.sample(list(sizes), min(3, len(sizes)))] for world, sizes in params["worlds"]],
            "seed": rng.randint(0, 1000)}


def _ring_trials(rank: int, world_size: int, sizes, seed: int, allreduce) -> list:
    return [ring.ring_trial(rank, world_size, n, allreduce=allreduce, seed=seed) for n in sizes]


def ring_drive(ns: dict, inputs: dict) -> list:
    fn = ns["ring_allreduce"]
    return [run_world(_ring_trials, world, sizes, inputs["seed"], fn, timeout_s=inputs["timeout_s"])
            for world, sizes in inputs["worlds"]]


def ring_check(inputs: dict, outputs, params: dict) -> Verdict:
    labels, cases = [], []
    for (world, sizes), per_rank in zip(inputs["worlds"], outputs, strict=True):
        for j, numel in enumerate(sizes):
            labels.append(f"{world} ranks, numel {numel}")
            cases.append((per_rank, j, numel))

    def check_one(i: int) -> None:
        per_rank, j, numel = cases[i]
        ring.check_ring([r[j] for r in per_rank], numel, seed=inputs["seed"], name="ring_allreduce")

    return per_case(labels, check_one)


# --- parameter server ------------------------------------------------------------------------

def ps_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    probes = []
    for _ in range(40):
        tau = rng.randint(0, 8)
        server = rng.randint(0, 200)
        probes.append((server, max(0, server - rng.randint(0, tau + 2)), tau))
    runs = [dict(run, seed=rng.randint(0, 1000)) for run in params["runs"]]
    return {"probes": probes, "runs": runs}


def ps_drive(ns: dict, inputs: dict) -> dict:
    rule = ns["bounded_staleness_rule"]
    answers = [bool(rule(*probe)) for probe in inputs["probes"]]
    servers = [run_world(ps.run_ps, r["world"], "bounded", r["tau"], r["steps"], r["lr"], r["seed"],
                         worker_delays=r["delays"], rule=rule, timeout_s=inputs["timeout_s"])[0]
               for r in inputs["runs"]]
    return {"answers": answers, "servers": servers}


def ps_check(inputs: dict, outputs, params: dict) -> Verdict:
    for probe, answer in zip(inputs["probes"], outputs["answers"], strict=True):
        if bool(answer) != ps.bounded_staleness_rule_ref(*probe):
            server, gradient, tau = probe
            return Verdict.failed(f"bounded_staleness_rule(server_version={server}, gradient_version={gradient}, "
                                  f"tau={tau}) returned {bool(answer)}")
    for run, server in zip(inputs["runs"], outputs["servers"], strict=True):
        worst = max(server["staleness"], default=0)
        if worst > run["tau"]:
            return Verdict.failed(f"a gradient {worst} versions old was applied with tau={run['tau']}")
        if not ps.converged(server):
            return Verdict(0.5, f"staleness bounded, but the loss {server['loss']:.4f} did not approach the optimum "
                                f"{server['optimal_loss']:.4f} (tau={run['tau']})")
    return Verdict.passed(f"rule correct on {len(inputs['probes'])} hidden cases; {len(inputs['runs'])} servers never "
                          "exceeded tau and converged")


# --- ZeRO-1 ----------------------------------------------------------------------------------

def zero_inputs(seed: int, params: dict) -> dict:
    """Per world, AdamW with weight decay and SGD with momentum, hyperparameters from the seed."""
    cases = _training_cases(seed, params)["cases"]
    rng = random.Random(seed + 1)
    for c in cases:
        c["runs"] = [["AdamW", {"lr": rng.choice([0.01, 0.02, 0.05]), "weight_decay": rng.choice([0.01, 0.05, 0.1]),
                                "betas": rng.choice([(0.9, 0.999), (0.8, 0.99)])}],
                     ["SGD", {"lr": rng.choice([0.05, 0.1]), "momentum": rng.choice([0.8, 0.9]),
                              "nesterov": rng.random() < 0.5, "weight_decay": rng.choice([0.0, 0.01])}]]
    return {"cases": cases}


def _zero_model_fn(case: dict):
    return functools.partial(ddp.small_mlp, case["seed"], case["d_in"], case["d_hidden"], case["d_out"])


def zero_drive(ns: dict, inputs: dict) -> list:
    cls = ns["Zero1"]
    return [run_world(zero.zero_trial, c["world"], _zero_model_fn(c), _data(c), c["steps"], c["runs"], zero_cls=cls,
                      timeout_s=inputs["timeout_s"]) for c in inputs["cases"]]


def zero_check(inputs: dict, outputs, params: dict) -> Verdict:
    labels, runs = [], []
    for i, c in enumerate(inputs["cases"]):
        for j, (opt_name, defaults) in enumerate(c["runs"]):
            labels.append(f"{opt_name}, {c['world']} ranks")
            runs.append((i, j, opt_name, defaults))

    def check_one(k: int) -> None:
        i, j, opt_name, defaults = runs[k]
        c, per_rank = inputs["cases"][i], outputs[i]
        if not isinstance(per_rank, list) or len(per_rank) != c["world"]:
            raise AssertionError("expected one result per rank")
        zero.check_zero([r[j] for r in per_rank], _zero_model_fn(c), opt_name, defaults, c["steps"],
                        name=f"Zero1, {c['world']} ranks")

    return per_case(labels, check_one)


# The trusted code each rank runs around the student's: bound before the cells, verified after.
INSTRUMENTS = tuple(f"fastdl_lab.distributed.{name}" for name in (
    "run_world", "launch.run_world", "ddp._train", "ddp._data_parallel", "ddp._detached_state",
    "ddp.broadcast_state", "ddp.allreduce_gradients_ref", "watch.ddp_trial", "watch._facts", "watch.allreduce_log",
    "watch.AllReduceLog.phase_now", "watch.AllReduceLog.backward_began", "watch.AllReduceLog.mark",
    "zero.zero_trial", "zero._zero_run", "zero.watching_optimizers", "zero.StateWatch.observe",
    "zero.StateWatch.held", "ps.run_ps", "ring.ring_trial",
    "ring.point_to_point_only", "ring.trial_input", "ring.census", "ring.c10d", "census.refuse_backends",
    "census.c10d")) + (
    "torch._C._distributed_c10d.ProcessGroup.allreduce", "torch._C._distributed_c10d.ProcessGroup.allreduce_coalesced",
    # Not the classes' step methods: torch wraps those itself when a class's first instance is built.
    "torch.optim.optimizer.register_optimizer_step_post_hook", "torch.optim.AdamW", "torch.optim.SGD", "torch.save")


def _with_timeout(make_inputs):
    """Every item's inputs carry the collective timeout: the profile's ``rank_timeout_s`` for the
    item, or RANK_TIMEOUT_S (what grading a world that deadlocks costs)."""
    def make(seed: int, params: dict) -> dict:
        return {**make_inputs(seed, params), "timeout_s": float(params.get("rank_timeout_s", RANK_TIMEOUT_S))}
    return make


# The names the graded functions and classes run with. Every item takes only its cell's functions
# and classes, screened (``engine/artefacts.py``): no code of the student's runs in the child beside
# the trusted driver, so nothing can rewrite what the driver counts or saves. FSDP's units move
# parameters through the package's helpers (``fsdp.drop_parameters``, ``fsdp.place_views``), as
# graded code may not assign to attributes of other objects.
SCOPE = "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
FSDP_SCOPE = SCOPE + "from fastdl_lab.distributed import fsdp\n"


def _item(name, points, cell, make_inputs, drive, check, artefacts, kind="correctness", description=""):
    return Item(name, points, (cell,), _with_timeout(make_inputs), drive, check, kind=kind, description=description,
                loopback=True, processes=8, instruments=INSTRUMENTS, artefacts=artefacts, scope=SCOPE)


LAB = LabSpec(
    name="07_distributed",
    preamble="from fastdl_lab import device\n",
    items=[
        _item("ddp_parity", 3, "ddp_code", _training_cases, ddp_drive, ddp_check, artefacts=("DDP",),
              description="DDP wrapper: rank 0's state broadcast, single-process parity, one all-reduce per "
                          "parameter launched during backward"),
        _item("bucketed_ddp", 3, "bucketed_code", _training_cases, bucketed_drive, bucketed_check, kind="mechanism",
              artefacts=("BucketedDDP",),
              description="bucketed DDP wrapper: parity from skewed starts, one all-reduce per bucket, launched "
                          "during backward"),
        _item("ring_allreduce", 3, "ring_code", ring_inputs, ring_drive, ring_check, artefacts=("ring_allreduce",),
              description="ring all-reduce from send/recv: exact sums and bytes, ragged sizes, 2-4 ranks"),
        # One comparison, so one point; the runs around it check that the server honours it.
        _item("parameter_server", 1, "ps_code", ps_inputs, ps_drive, ps_check, kind="mechanism",
              artefacts=("bounded_staleness_rule",), description="bounded staleness never exceeds tau and converges"),
        _item("zero1", 2, "zero_code", zero_inputs, zero_drive, zero_check, artefacts=("Zero1",),
              description="ZeRO-1 around torch optimizers: bit-identical to AdamW and SGD, each parameter's "
                          "state on one rank, balanced"),
    ],
)


# --- FSDP (ZeRO-3) and the tensor-parallel MLP -------------------------------------------------
# Their figures are taken inside the ranks by fastdl_lab.distributed.census, bound before the
# student's classes exist and verified after the run, and judged here against references computed
# in this process.

import torch  # noqa: E402

from fastdl_lab.distributed import fsdp, tensor_parallel  # noqa: E402

# The census's functions, and the names through which the trusted loops reach them.
SHARDING_INSTRUMENTS = INSTRUMENTS + tuple(f"fastdl_lab.distributed.{name}" for name in (
    "fsdp.train_fsdp", "fsdp._sgd_step", "fsdp.functional_sgd", "fsdp.unit_mlp", "fsdp.census", "tensor_parallel.tp_trial", "tensor_parallel.census",
    "census.snapshot", "census.Snapshot", "census.Snapshot.__init__", "census.Snapshot.storages_now",
    "census.Snapshot.changed", "census.Snapshot.__exit__", "census._storages_of", "census.resident_bytes",
    "census.storage_bytes", "census._storage",
    "census._nbytes", "census._tensor_bytes", "census._subclasses", "census._digest", "census.sharded_collectives",
    "census.allreduce_only", "census._process_group_mode", "census.WireLog", "census.WireLog.before_gather",
    "census.WireLog.gathered_storages", "census.WireLog.summary", "census.gc", "census.hashlib", "census.torch",
    "census.c10d", "census.StorageWeakRef")) + (
    "gc.get_objects", "gc.collect", "gc.freeze", "gc.unfreeze", "torch.Tensor.untyped_storage", "torch.Tensor.numel",
    "torch.Tensor.element_size", "torch.UntypedStorage.nbytes", "torch.TypedStorage.untyped",
    "torch.multiprocessing.reductions.StorageWeakRef.expired", "torch.optim.sgd.sgd")


def _fsdp_cases(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for world in params["worlds"]:
        dims = [rng.randint(params.get("min_width", 12), params.get("max_width", 36))
                for _ in range(int(params.get("units", 4)) + 1)]
        cases.append({"seed": rng.randint(0, 10_000), "dims": dims, "n": world * rng.randint(3, 6),
                      "steps": int(params.get("steps", 3)), "lr": rng.choice([0.05, 0.1, 0.2]), "world": world})
    return {"cases": cases, "dtype": ""}


def _fsdp_mixed_cases(seed: int, params: dict) -> dict:
    return {**_fsdp_cases(seed, params), "dtype": "bfloat16"}


def _fsdp_model_fn(case: dict):
    return functools.partial(fsdp.unit_mlp, case["seed"], case["dims"])


def _fsdp_data(case: dict):
    return ddp.make_regression(case["seed"], case["n"], case["dims"][0], case["dims"][-1])


def _compute_dtype(inputs: dict):
    return getattr(torch, inputs["dtype"]) if inputs["dtype"] else None


def _fsdp_label(case: dict) -> str:
    return f"{case['world']} ranks, widths {case['dims']}"


def fsdp_drive(ns: dict, inputs: dict) -> list:
    cls = ns["FSDPUnit"]
    return [run_world(fsdp.train_fsdp, c["world"], _fsdp_model_fn(c), _fsdp_data(c), c["steps"], c["lr"],
                      unit_cls=cls, compute_dtype=_compute_dtype(inputs), timeout_s=inputs["timeout_s"])
            for c in inputs["cases"]]


def fsdp_check(inputs: dict, outputs, params: dict) -> Verdict:
    """A third for parity, a third for the memory each rank kept, a third for the collectives."""
    cases, dtype = inputs["cases"], _compute_dtype(inputs)
    references = [fsdp.train_reference(_fsdp_model_fn(c), _fsdp_data(c), c["steps"], c["lr"]) for c in cases]

    def check_one(i: int) -> None:
        c = cases[i]
        lowp = (fsdp.train_reference(_fsdp_model_fn(c), _fsdp_data(c), c["steps"], c["lr"], compute_dtype=dtype,
                                     world_size=c["world"]) if dtype else None)
        if not isinstance(outputs[i], list) or len(outputs[i]) != c["world"]:
            raise AssertionError("expected one result per rank")
        fsdp.check_parity(outputs[i], references[i], name="FSDPUnit", lowp_reference=lowp)

    parity = per_case([_fsdp_label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return Verdict(parity.fraction / 3, parity.reason)
    memory, wire = [], []
    for c, results, reference in zip(cases, outputs, references, strict=True):
        memory += [f"{_fsdp_label(c)}: {p}" for p in fsdp.memory_problems(results, reference)]
        wire += [f"{_fsdp_label(c)}: {p}" for p in fsdp.wire_problems(results, reference, c["steps"], dtype)]
    held = outputs[0][0]["memory"]["param_bytes"]
    full = 4 * sum(p.numel() for p in references[0].parameters())
    if not memory and not wire:
        worlds = f"{len(cases)} hidden world{'s' * (len(cases) != 1)}"
        return Verdict.passed(f"parity on {worlds}; each rank keeps its 1/N shard ({held} B of {full} B in the "
                              "first), two all-gathers and one reduce-scatter per unit and step")
    lost = " ".join(problems[0] for problems in (memory, wire) if problems)
    return Verdict(1 - (bool(memory) + bool(wire)) / 3, f"weights correct, but {lost}")


def tp_cases(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    return {"cases": [{"seed": rng.randint(0, 10_000), "tokens": rng.randint(3, 9), "d_model": rng.randint(6, 16),
                       "d_hidden": world * rng.randint(3, 8) + rng.randint(1, world - 1), "world": world}
                      for world in params["worlds"]]}


def _tp_label(case: dict) -> str:
    return f"{case['world']} ranks, d_model {case['d_model']}, d_hidden {case['d_hidden']}"


def tp_drive(ns: dict, inputs: dict) -> list:
    column, row = ns["ColumnParallelLinear"], ns["RowParallelLinear"]
    return [run_world(tensor_parallel.tp_trial, c["world"], c["seed"], c["tokens"], c["d_model"], c["d_hidden"],
                      column_cls=column, row_cls=row, timeout_s=inputs["timeout_s"]) for c in inputs["cases"]]


def tp_check(inputs: dict, outputs, params: dict) -> Verdict:
    """Half for the output and gradients of the unsplit MLP, half for one all-reduce per pass."""
    cases = inputs["cases"]

    def check_one(i: int) -> None:
        c = cases[i]
        if not isinstance(outputs[i], list) or len(outputs[i]) != c["world"]:
            raise AssertionError("expected one result per rank")
        tensor_parallel.check_tp(outputs[i], c["seed"], c["tokens"], c["d_model"], c["d_hidden"])

    parity = per_case([_tp_label(c) for c in cases], check_one)
    if parity.fraction < 1:
        return Verdict(parity.fraction / 2, parity.reason)
    problems = [f"{_tp_label(c)}: {p}" for c, results in zip(cases, outputs, strict=True)
                for p in tensor_parallel.allreduce_problems(results)]
    if problems:
        return Verdict(0.5, f"output and gradients correct, but {problems[0]}")
    return Verdict.passed(f"output and gradients equal the unsplit MLP on {len(cases)} hidden "
                          f"world{'s' * (len(cases) != 1)}, with one all-reduce in forward and one in backward")


def _sharding_item(name, points, cell, make_inputs, drive, check, description, artefacts, scope=SCOPE):
    return Item(name, points, (cell,), _with_timeout(make_inputs), drive, check, kind="mechanism",
                description=description, loopback=True, processes=8, instruments=SHARDING_INSTRUMENTS,
                artefacts=artefacts, scope=scope)


LAB.items += [
    _sharding_item("fsdp", 3, "fsdp_code", _fsdp_cases, fsdp_drive, fsdp_check,
                   "FSDP: parity, 1/N of the weights per rank, gathered and freed unit by unit",
                   artefacts=("FSDPUnit",), scope=FSDP_SCOPE),
    _sharding_item("fsdp_mixed", 2, "fsdp_code", _fsdp_mixed_cases, fsdp_drive, fsdp_check,
                   "FSDP in bf16 with fp32 master shards: parity within bf16's error, 1/N per rank",
                   artefacts=("FSDPUnit",), scope=FSDP_SCOPE),
    _sharding_item("tp_mlp", 3, "tp_code", tp_cases, tp_drive, tp_check,
                   "tensor-parallel MLP: column then row split, parity, one all-reduce per pass",
                   artefacts=("CopyToTensorParallel", "ReduceFromTensorParallel", "ColumnParallelLinear",
                              "RowParallelLinear")),
]
