"""What every rank of a lab 07 world runs: the trusted drives around the student's classes.

Each function here is an ``Item.drive`` of a world (``items.Worlds``): it runs in one rank's
sandboxed child, joined to the grader's relay before the student's code existed there, with only
that rank's inputs (its shard of the data, its own tensor, its own starting weights). The
process is the student's as soon as their code is loaded, so nothing a drive returns is taken for
more than a value the grader checks; what crossed between ranks is read from the relay's log.

Drives call ``dist.barrier()`` after each phase (construction, a step, a trial, a pass) so that
the log can be cut into phases (``traffic.py``), and mark, with ``relay_backend.mark``, where the
rank's own backward begins and ends: those marks are self-reported, and so is everything a drive
counts in-process (``zero.StateWatch``, the storage ``census``, the gathers it saw alive).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autograder.engine import relay_backend
from fastdl_lab.distributed import census, ddp, fsdp, ps, watch, zero

# --- data parallel: DDP and BucketedDDP ---------------------------------------------------------


def ddp_rank(ns: dict, inputs: dict) -> dict:
    """Train a replica with the student's wrapper from this rank's own start: barriers after
    construction and after each step's synchronisation, marks around each step's backward."""
    case, world_size = inputs["case"], inputs["world_size"]
    cls = ns[inputs["class_name"]]
    model = ddp.rank_skewed_mlp(0, case["d_in"], case["d_hidden"], case["d_out"], rank=0)
    model.load_state_dict(inputs["state"])
    kwargs = {"bucket_bytes": case["extra"]} if case["extra"] else {}
    net, finish = ddp._data_parallel(model, cls, world_size, kwargs)
    start = ddp._detached_state(model)
    facts = watch._facts(net, model)
    dist.barrier()
    opt = torch.optim.SGD(net.parameters(), lr=case["lr"])
    for step in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = ddp._loss(net, inputs["x"], inputs["y"])
        relay_backend.mark(f"backward {step}")
        loss.backward()
        relay_backend.mark(f"finish {step}")
        finish()
        dist.barrier()
        opt.step()
    return {"start": start, "state": ddp._detached_state(model), "facts": facts}


# --- ring all-reduce ------------------------------------------------------------------------------


def ring_rank(ns: dict, inputs: dict) -> list[dict]:
    """All-reduce this rank's own tensor of each trial with the student's ring, a barrier after each."""
    ring_allreduce = ns["ring_allreduce"]
    results = []
    for tensor in inputs["tensors"]:
        out = tensor.clone()
        reported = ring_allreduce(out)
        results.append({"out": out, "reported": reported if isinstance(reported, (int, float)) else None})
        dist.barrier()
    return results


# --- parameter server -----------------------------------------------------------------------------


def _served(inputs: dict, mode: str, **rule) -> list[dict]:
    """Each run of ``inputs`` in ``mode``, the student's rule given as ``run_ps``'s keyword; a
    barrier after each run keeps one run's messages out of the next."""
    results = []
    for run in inputs["runs"]:
        results.append(ps.run_ps(inputs["rank"], inputs["world_size"], mode, run["tau"], run["steps"], run["lr"],
                                 run["seed"], worker_delays=run["delays"], **rule))
        dist.barrier()
    return results


def ps_rank(ns: dict, inputs: dict) -> dict:
    """Rank 0 answers the rule's probes and serves each run; the others are workers. What the
    server records (staleness, losses) is counted in its own process: self-reported."""
    rule = ns["bounded_staleness_rule"]
    answers = [bool(rule(*probe)) for probe in inputs["probes"]]
    return {"answers": answers, "results": _served(inputs, "bounded", rule=rule)}


def ssp_rank(ns: dict, inputs: dict) -> dict:
    """As ``ps_rank``, with the student's start rule in SSP mode (each probe gets its own list)."""
    rule = ns["ssp_may_start"]
    answers = [bool(rule(list(clocks), worker, tau)) for clocks, worker, tau in inputs["probes"]]
    return {"answers": answers, "results": _served(inputs, "ssp", start_rule=rule)}


# --- ZeRO-1 ---------------------------------------------------------------------------------------


def _zero_model(case: dict) -> nn.Module:
    return ddp.small_mlp(0, case["d_in"], case["d_hidden"], case["d_out"])


def memory_block(seed: int, width: int, last: bool) -> nn.Sequential:
    """One square Linear layer drawn from ``seed``, then tanh unless it is the ``last``."""
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(width, width)
    with torch.no_grad():
        linear.weight.normal_(0.0, width ** -0.5, generator=generator)
        linear.bias.normal_(0.0, 0.1, generator=generator)
    return nn.Sequential(linear) if last else nn.Sequential(linear, nn.Tanh())


def memory_blocks(spec: dict):
    """A memory world's model (``spec``: seed, width, layers), one block at a time: large enough
    that what a rank keeps shows in its cgroup's memory peak, and built so that a rank never holds
    more of it than it keeps (as FSDP builds on the meta device, then materialises unit by unit)."""
    for u in range(spec["layers"]):
        yield memory_block(spec["seed"] + u, spec["width"], last=u == spec["layers"] - 1)


def _sums(tensors) -> list[list[float]]:
    """Per tensor, its sum and sum of squares in float64: a memory world's weights, small enough
    to send back, and wrong wherever an update was."""
    return [[float(t.double().sum()), float(t.double().square().sum())] for t in tensors]


def zero_rank(ns: dict, inputs: dict) -> list[dict] | dict:
    """ZeRO-1 with the student's class around each optimizer of the case: gradients averaged by the
    trusted loop, a barrier before and after each ``step()`` (whose broadcasts the relay logs), the
    state the optimizers hold watched in-process (self-reported). A memory world trains the large
    model once and returns only its weights' sums."""
    cls, world_size = ns["Zero1"], inputs["world_size"]
    if "memory" in inputs:
        spec = inputs["memory"]
        model = nn.Sequential(*memory_blocks(spec))
        _zero_run(cls, model, inputs["x"], inputs["y"], world_size, spec["steps"], spec["optimizer"],
                  spec["defaults"], keep_grads=False)
        return {"sums": _sums(model.parameters())}
    case, results = inputs["case"], []
    for name, defaults in case["runs"]:
        model = _zero_model(case)
        model.load_state_dict(inputs["state"])
        results.append(_zero_run(cls, model, inputs["x"], inputs["y"], world_size, case["steps"], name, defaults))
    return results


def _zero_run(cls, model: nn.Module, x, y, world_size: int, steps: int, name: str, defaults: dict,
              keep_grads: bool = True) -> dict:
    params = list(model.parameters())
    opt_class = zero.optimizer_class(name)
    opt = cls(model.parameters(), optimizer_class=opt_class, **dict(defaults))
    dist.barrier()
    grads = []
    with zero.watching_optimizers(params, opt_class) as state:
        for _ in range(steps):
            for p in params:
                p.grad = None
            ddp._loss(model, x, y).backward()
            ddp.allreduce_gradients_ref(model, world_size)
            if keep_grads:
                grads.append([p.grad.clone() for p in params])
            dist.barrier()
            opt.step()
            dist.barrier()
    return {"state": ddp._detached_state(model), "grads": grads, **state.held()}


# --- FSDP -----------------------------------------------------------------------------------------


class _GatherWatch:
    """The gathers this rank's process group is asked for, with ``census.WireLog`` counting the
    earlier gathers' buffers still allocated at each one: counted in the rank, self-reported."""

    def __init__(self):
        self.log = census.WireLog()
        group = dist.group.WORLD
        original = group.all_gather_single

        def watched(output, input, opts=None):
            self.log.before_gather([output])
            return original(output, input, opts) if opts is not None else original(output, input)

        group.all_gather_single = group._allgather_base = watched


def fsdp_rank(ns: dict, inputs: dict) -> dict:
    """Fully sharded SGD with momentum with the student's unit class, a barrier after construction
    and after each step. What the rank holds after training is counted in-process (``census``:
    self-reported); what crossed, by the relay. A memory world counts nothing in the rank: its
    figure is the rank child's cgroup peak, which the census's own walks would blur."""
    cls = ns["FSDPUnit"]
    dtype = getattr(torch, inputs["dtype"]) if inputs["dtype"] else None
    spec = inputs.get("memory")
    if spec:
        units = [cls(block, compute_dtype=dtype) for block in memory_blocks(spec)]
        model = _fsdp_train(units, inputs, dtype)[0]
        return {"sums": _unit_sums(model, len(units))}
    gathers = _GatherWatch()
    with census.snapshot() as before:
        units = [cls(block, compute_dtype=dtype) for block in fsdp_model(inputs)]
        model, momentum, out_dtype = _fsdp_train(units, inputs, dtype)
        params = list(model.parameters())
        state = [buf for buf in momentum if buf is not None]
        memory = {"param_bytes": census.storage_bytes(params),
                  "grad_bytes": census.storage_bytes([p.grad for p in params if p.grad is not None]),
                  "state_bytes": census.storage_bytes(state),
                  "resident_bytes": census.resident_bytes(before, exclude=state, also=gathers.log.gathered_storages()),
                  "foreign_params": fsdp.foreign_parameters(model)}
    return {"params": fsdp.named_pieces(model), "memory": memory, "wire": gathers.log.summary(),
            "output_dtype": out_dtype}


def fsdp_model(inputs: dict) -> nn.Sequential:
    """A case's model: an MLP of units, or a token model (an embedding tied to a projection)."""
    if inputs.get("vocab"):
        return fsdp.unit_lm(inputs["seed"], inputs["vocab"], inputs["width"], inputs["hidden"], inputs["out"])
    return fsdp.unit_mlp(inputs["seed"], inputs["dims"])


def _unit_sums(model: nn.Module, units: int) -> list[list[float]]:
    """A memory world's weights per unit, by the units' own parameters' names (``0.0.weight`` is
    unit 0's): sum and sum of squares of this rank's pieces of them."""
    pieces: list[list[torch.Tensor]] = [[] for _ in range(units)]
    for name, p in model.named_parameters():
        pieces[int(fsdp.clean_name(name).split(".")[0])].append(p.detach().reshape(-1))
    return _sums(torch.cat(ps) if ps else torch.zeros(0) for ps in pieces)


def _fsdp_train(units: list, inputs: dict, dtype) -> tuple[nn.Module, list, str | None]:
    model = nn.Sequential(*units)
    params = list(model.parameters())
    momentum: list = [None] * len(params)
    dist.barrier()
    out_dtype = None
    for _ in range(inputs["steps"]):
        for p in params:
            p.grad = None
        out = model(inputs["x"])
        out_dtype = str(out.dtype)
        F.mse_loss(out.float(), inputs["y"]).backward()
        del out
        fsdp._sgd_step(params, momentum, inputs["lr"])
        dist.barrier()
    return model, momentum, out_dtype


# --- tensor parallel ------------------------------------------------------------------------------

WEIGHTS = ("w1", "b1", "w2", "b2")


def tp_rank(ns: dict, inputs: dict) -> dict:
    """The student's column- then row-parallel MLP on this rank's shards alone: a barrier after
    construction, after forward and after backward, so that the relay's log shows each pass's
    all-reduces apart."""
    shard = {k: nn.Parameter(inputs[k].clone()) for k in WEIGHTS}
    x = inputs["x"].clone().requires_grad_()
    column = ns["ColumnParallelLinear"](shard["w1"], shard["b1"])
    row = ns["RowParallelLinear"](shard["w2"], shard["b2"])
    dist.barrier()
    y = row(F.gelu(column(x)))
    dist.barrier()
    grads = torch.autograd.grad(y, [x, *(shard[k] for k in WEIGHTS)], inputs["dy"], allow_unused=True)
    dist.barrier()
    missing = [name for name, g in zip(("x", *WEIGHTS), grads) if g is None]
    if missing:
        raise ValueError(f"no gradient reached {', '.join(missing)}: the layers must compute with the parameters "
                         "they are given")
    return {"y": y.detach(), "dx": grads[0], **{f"d{k}": g for k, g in zip(WEIGHTS, grads[1:])}}
