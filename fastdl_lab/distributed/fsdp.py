"""Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP) from scratch (lab 07).

ZeRO-1 (``zero``) shards the optimizer state; every rank still holds every weight. FSDP shards
the weights too. The model is cut into *units* (here: the blocks of an ``nn.Sequential``); each
unit's parameters are flattened into one vector, padded to a multiple of the world size N, and
rank r keeps only the r-th of N equal pieces: its **shard**, the only parameter the optimizer
sees. A unit's full weights exist only while that unit computes:

1. before the unit's forward, an **all-gather** of the shards rebuilds the flat vector, and the
   layers' weights become views into it;
2. after the forward, the vector's storage is **freed** (``untyped_storage().resize_(0)``): the
   autograd graph still refers to the views, so dropping a Python reference would free nothing;
3. when backward reaches the unit, a hook on its output **re-gathers** into the same storage, so
   the tensors autograd saved become valid again;
4. after the unit's backward, the gradient of the flat vector is **reduce-scattered** (each rank
   receives the sum of everyone's gradient for its own shard), divided by N, and left as the
   shard's ``.grad``; the storage is freed again.

A rank therefore holds 1/N of the parameters, gradients and optimizer state, plus one unit's full
weights at a time; the price is one more all-gather per unit and step than ZeRO-1's traffic
(Rajbhandari et al., 2020; Zhao et al., *PyTorch FSDP*, VLDB 2023). With ``compute_dtype`` the
shards stay fp32 *master* weights while the gathers, and the unit's arithmetic, are bf16.

``train_fsdp`` is the trusted loop: it builds the units with any class that follows
``FSDPUnit``'s protocol, trains with SGD on the shards, and measures what the rank holds and
what crossed the wire itself (``census``), never trusting a number the unit reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.sgd import sgd as functional_sgd

from fastdl_lab import checks
from fastdl_lab.distributed import census
from fastdl_lab.distributed.ddp import _shard, make_regression
from fastdl_lab.distributed.launch import rank_device, run_world

MOMENTUM = 0.9


# --- the flat layout every unit shares ----------------------------------------------------------

def flat_layout(module: nn.Module, world_size: int) -> tuple[list[tuple[nn.Module, str, torch.Size]], int, int]:
    """Where each parameter of ``module`` lives in its unit's flat vector.

    Returns ``(slots, numel, shard_size)``: one ``(owner, name, shape)`` per parameter in
    ``named_parameters()`` order (owner is the submodule that holds it as ``owner.<name>``), the
    total number of elements, and the elements per shard, ``ceil(numel / world_size)``. The flat
    vector is the parameters' ``reshape(-1)`` one after another, then zeros up to
    ``shard_size * world_size``; rank r's shard is elements ``r * shard_size`` to
    ``(r + 1) * shard_size``.
    """
    slots, numel = [], 0
    for name, p in module.named_parameters():
        owner_name, _, attr = name.rpartition(".")
        slots.append((module.get_submodule(owner_name), attr, p.shape))
        numel += p.numel()
    if numel == 0:
        raise ValueError("a unit needs at least one parameter to shard")
    return slots, numel, math.ceil(numel / world_size)


def _checked_slot(owner, name) -> None:
    if not isinstance(owner, nn.Module) or not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise TypeError(f"a slot is (submodule, public attribute name, shape) from flat_layout, not ({owner!r}, {name!r})")


def drop_parameters(slots: Sequence[tuple[nn.Module, str, torch.Size]]) -> None:
    """Remove each slot's parameter from the submodule that holds it: from now on the layers see
    whatever ``place_views`` puts there, and the unit's shard is the only parameter left."""
    for owner, name, _ in slots:
        _checked_slot(owner, name)
        if name not in owner._parameters:
            raise ValueError(f"{type(owner).__name__} has no parameter {name!r} to drop")
        delattr(owner, name)


def place_views(slots: Sequence[tuple[nn.Module, str, torch.Size]], full: torch.Tensor) -> None:
    """Point every slot's attribute at its piece of the flat vector ``full`` (views: no copy)."""
    offset = 0
    for owner, name, shape in slots:
        _checked_slot(owner, name)
        n = math.prod(shape)
        setattr(owner, name, full[offset:offset + n].view(shape))
        offset += n


def flatten_padded(tensors: Sequence[torch.Tensor], padded_numel: int) -> torch.Tensor:
    """The tensors one after another as one vector, zero-padded to ``padded_numel`` elements."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    return F.pad(flat, (0, padded_numel - flat.numel()))


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory but keep the tensor, its views and every saved reference to it."""
    t.untyped_storage().resize_(0)


def allocate_storage(t: torch.Tensor) -> None:
    """Give a freed ``t`` back the bytes its shape needs (the values are undefined until written)."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


# --- the reference unit -------------------------------------------------------------------------

class _GatherParams(torch.autograd.Function):
    """Forward: the unit's full flat vector, all-gathered from the shards. Backward: its
    gradient, reduce-scattered into this rank's shard and averaged over the ranks."""

    @staticmethod
    def forward(ctx, shard, unit):
        ctx.unit = unit
        ### BEGIN SOLUTION
        unit.gather()
        # ``.data`` is a new tensor on the same storage with a version counter of its own: the
        # re-gather before backward writes through ``unit.full``, and autograd must not take
        # that write for an in-place change of the views it saved.
        return unit.full.data
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_full):
        unit = ctx.unit
        ### BEGIN SOLUTION
        mine = torch.empty_like(unit.shard)
        dist.reduce_scatter_single(mine, grad_full.to(mine.dtype).contiguous())
        mine /= unit.world_size
        unit.free()
        return mine, None
        ### END SOLUTION


class FSDPUnit(nn.Module):
    """One unit of a fully sharded model: ``module``'s parameters live as this rank's shard.

    The protocol ``train_fsdp`` relies on: ``FSDPUnit(module, compute_dtype=None)`` is built on
    every rank from identical modules; its only parameter is ``shard``, fp32, of
    ``shard_size`` elements, laid out as in ``flat_layout``; ``forward(x)`` returns the module's
    output (in ``compute_dtype`` when given). ``next_unit``, when set, is the unit that runs
    next: its all-gather is started while this one computes (prefetch).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = flat_layout(module, self.world_size)
        flat = flatten_padded([p for p in module.parameters()], self.shard_size * self.world_size)
        start = self.rank * self.shard_size
        self.shard = nn.Parameter(flat[start:start + self.shard_size].float().clone())
        self.compute_dtype = compute_dtype or self.shard.dtype
        self.full = torch.empty(self.shard_size * self.world_size, dtype=self.compute_dtype, device=flat.device)
        free_storage(self.full)
        drop_parameters(self.slots)  # from now on the layers see views of ``full``
        self.next_unit: FSDPUnit | None = None
        self._pending = None

    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into ``full`` (its storage re-allocated first)."""
        ### BEGIN SOLUTION
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.compute_dtype), async_op=async_op)
        if async_op:
            self._pending = work
        ### END SOLUTION

    def free(self) -> None:
        """Release the full weights' memory."""
        free_storage(self.full)

    def use_views(self, full: torch.Tensor) -> None:
        """Point every layer's weight at its piece of ``full`` (views: no copy)."""
        place_views(self.slots, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        full = _GatherParams.apply(self.shard, self)
        if self.next_unit is not None:
            self.next_unit.gather(async_op=True)
        self.use_views(full)
        out = self.module(x.to(self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out
        ### END SOLUTION

    def before_backward(self, grad: torch.Tensor) -> None:
        ### BEGIN SOLUTION
        self.gather()
        ### END SOLUTION


def link_prefetch(units: Sequence[nn.Module]) -> None:
    """Let each unit start the next one's all-gather during its own forward."""
    for unit, following in zip(units, units[1:]):
        unit.next_unit = following


# --- model, data and the single-process reference ----------------------------------------------

def unit_mlp(seed: int, dims: Sequence[int]) -> nn.Sequential:
    """An MLP as a sequence of units: Linear + Tanh for each hidden size, a last Linear alone.

    ``dims`` are the widths from input to output; weights are drawn from ``seed``, so every call
    (and every rank) builds the same model.
    """
    if len(dims) < 2:
        raise ValueError(f"an MLP needs an input and an output width, got dims={list(dims)}")
    blocks = []
    for i, (d_in, d_out) in enumerate(zip(dims, dims[1:])):
        layers = [nn.Linear(d_in, d_out)] + ([nn.Tanh()] if i < len(dims) - 2 else [])
        blocks.append(nn.Sequential(*layers))
    model = nn.Sequential(*blocks)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(checks.randn(p.shape, seed=seed * 100 + i, scale=p.shape[-1] ** -0.5))
    return model


def _run_units(blocks, x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    if compute_dtype is None:
        return blocks(x)
    # Mixed precision as FSDP does it: each unit's fp32 weights cast for its own computation.
    for block in blocks:
        weights = {name: p.to(compute_dtype) for name, p in block.named_parameters()}
        x = torch.func.functional_call(block, weights, (x.to(compute_dtype),))
    return x


def train_reference(model_fn: Callable[[], nn.Module], data, steps: int, lr: float,
                    compute_dtype: torch.dtype | None = None, world_size: int = 1) -> nn.Module:
    """SGD with momentum in one process; returns the trained model.

    By default on the whole batch, in fp32: what FSDP must reproduce. With ``compute_dtype``
    each unit computes in that dtype from its fp32 weights, as FSDP's mixed precision does; with
    ``world_size`` the batch is cut into that many equal slices whose gradients are averaged in
    fp32, so the run rounds exactly where FSDP on as many ranks would.
    """
    x, y = data
    model = model_fn()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    slices = list(zip(x.chunk(world_size), y.chunk(world_size)))
    for _ in range(steps):
        total = [torch.zeros_like(p) for p in params]
        for xs, ys in slices:
            loss = F.mse_loss(_run_units(model, xs, compute_dtype).float(), ys)
            for acc, g in zip(total, torch.autograd.grad(loss, params)):
                acc += g
        for p, acc in zip(params, total):
            p.grad = acc / world_size
        opt.step()
    return model


# --- the trusted loop ---------------------------------------------------------------------------

@torch.no_grad()
def _sgd_step(params: list[torch.Tensor], momentum: list, lr: float) -> None:
    """``torch.optim.SGD(params, lr, momentum=MOMENTUM).step()`` through the function the class
    calls: same arithmetic, but the class's step imports torch._dynamo on first use, seconds
    in every forked rank. ``momentum`` holds the buffers, filled on the first step."""
    live = [i for i, p in enumerate(params) if p.grad is not None]
    buffers = [momentum[i] for i in live]
    functional_sgd([params[i] for i in live], [params[i].grad for i in live], buffers, weight_decay=0.0,
                   momentum=MOMENTUM, lr=lr, dampening=0.0, nesterov=False, maximize=False)
    for i, buf in zip(live, buffers):
        momentum[i] = buf


def train_fsdp(rank: int, world_size: int, model_fn: Callable[[], nn.Sequential], data, steps: int, lr: float,
               unit_cls=FSDPUnit, compute_dtype: torch.dtype | None = None, prefetch: bool = False) -> dict:
    """Fully sharded SGD (with momentum) on this rank's slice of ``data``.

    Every block of ``model_fn()`` becomes ``unit_cls(block, compute_dtype=...)``; the optimizer
    steps on the units' parameters. Returns this rank's shards (one per unit, in order) and what
    ``census`` measured: collectives, the most gathered weights alive at once, and after the
    last step the bytes of the shards, of their gradients, and of every tensor this training
    left alive in the process apart from the data and the optimizer's state (``resident_bytes``).
    """
    x, y = _shard(data, rank, world_size)
    with census.snapshot() as before:
        with census.sharded_collectives() as wire:
            units = [unit_cls(block.to(rank_device()), compute_dtype=compute_dtype) for block in model_fn()]
            if prefetch:
                link_prefetch(units)
            model = nn.Sequential(*units)
            params = list(model.parameters())
            momentum: list[torch.Tensor | None] = [None] * len(params)
            out_dtype = None
            for _ in range(steps):
                for p in params:
                    p.grad = None
                out = model(x)
                out_dtype = str(out.dtype)
                F.mse_loss(out.float(), y).backward()
                del out
                _sgd_step(params, momentum, lr)
        state = [buf for buf in momentum if buf is not None]
        memory = {
            "param_bytes": census.storage_bytes(params),
            "grad_bytes": census.storage_bytes([p.grad for p in params if p.grad is not None]),
            "state_bytes": census.storage_bytes(state),
            "resident_bytes": census.resident_bytes(before, exclude=state, also=wire.gathered_storages()),
        }
    return {"shards": [p.detach().clone() for p in params], "memory": memory, "wire": wire.summary(),
            "output_dtype": out_dtype}


# --- checks, in the parent ----------------------------------------------------------------------

def unit_sizes(model: nn.Sequential, world_size: int) -> list[tuple[int, int]]:
    """(numel, shard_size) of every unit of ``model`` over ``world_size`` ranks."""
    return [flat_layout(block, world_size)[1:] for block in model]


def unflatten_shards(results: list[dict], reference: nn.Sequential) -> dict[str, torch.Tensor]:
    """The full weights the ranks' shards put together, named as ``reference.named_parameters()``."""
    world_size = len(results)
    weights = {}
    for u, (block, (numel, shard_size)) in enumerate(zip(reference, unit_sizes(reference, world_size))):
        shards = []
        for rank, result in enumerate(results):
            shard = result["shards"][u] if u < len(result["shards"]) else None
            if not isinstance(shard, torch.Tensor) or shard.shape != (shard_size,) or shard.dtype != torch.float32:
                got = f"{tuple(shard.shape)} {shard.dtype}" if isinstance(shard, torch.Tensor) else type(shard).__name__
                raise checks.MismatchError(f"rank {rank} unit {u}: its parameter is {got}; a shard of this unit "
                                           f"is ({shard_size},) float32 ({numel} elements over {world_size} ranks)")
            shards.append(shard)
        flat, offset = torch.cat(shards), 0
        for name, p in block.named_parameters():
            weights[f"{u}.{name}"] = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return weights


def check_parity(results: list[dict], reference: nn.Sequential, name: str = "FSDP",
                 lowp_reference: nn.Sequential | None = None) -> None:
    """The weights the shards make equal the single-process ones: to fp32 rounding, or, given
    ``lowp_reference`` (``train_reference`` with bf16 units and the ranks' slices), no further
    from the fp32 ``reference`` than twice that run's own error."""
    if any(len(r["shards"]) != len(reference) for r in results):
        counts = [len(r["shards"]) for r in results]
        raise checks.MismatchError(f"{name}: ranks returned {counts} parameters; expected one shard per unit "
                                   f"({len(reference)})")
    got = unflatten_shards(results, reference)
    lowp = dict(lowp_reference.named_parameters()) if lowp_reference is not None else None
    for key, expected in reference.named_parameters():
        if lowp is None:
            checks.assert_close(got[key], expected.detach(), atol=1e-5, rtol=1e-4, name=f"{name} {key}")
        else:
            error = (got[key] - expected).abs().max().item()
            bound = 2 * (lowp[key] - expected).abs().max().item() + 1e-6
            if not error <= bound:
                raise checks.MismatchError(f"{name} {key}: max error {error:.3g} against fp32 training; one process "
                                           f"in bf16 is off by {bound / 2:.3g}, and at most twice that is allowed")


def memory_problems(results: list[dict], reference: nn.Sequential) -> list[str]:
    """What is wrong with the memory each rank kept after its last step (empty when 1/N).

    A rank must hold its fp32 shards (exactly their bytes), their gradients and the optimizer's
    momentum for them (exactly the shards' bytes again: the loop leaves that state out of the
    count, so nothing may hide there); anything else that stays alive may add at most half of
    the shards and gradients again.
    """
    world_size = len(results)
    shard_bytes = 4 * sum(shard for _, shard in unit_sizes(reference, world_size))
    full_bytes = 4 * sum(p.numel() for p in reference.parameters())
    problems = []
    for rank, result in enumerate(results):
        mem = result["memory"]
        if mem["param_bytes"] != shard_bytes:
            problems.append(f"rank {rank} optimises {mem['param_bytes']} B of parameters; its fp32 shards are "
                            f"{shard_bytes} B (the whole model: {full_bytes} B)")
        elif mem["state_bytes"] != shard_bytes:
            problems.append(f"rank {rank}: the optimizer's state is {mem['state_bytes']} B; momentum for the "
                            f"shards is {shard_bytes} B")
        elif mem["resident_bytes"] > 2.5 * shard_bytes + 1024:
            problems.append(f"rank {rank} still holds {mem['resident_bytes']} B of tensors after the step; shards "
                            f"and their gradients are {2 * shard_bytes} B (the whole model: {full_bytes} B): "
                            "full weights or gradients were kept")
    return problems


def wire_problems(results: list[dict], reference: nn.Sequential, steps: int,
                  compute_dtype: torch.dtype | None = None) -> list[str]:
    """What is wrong with the collectives: two all-gathers (forward, backward) and one
    reduce-scatter per unit and step, gathers in the compute dtype, an output in the compute
    dtype, and when a unit is gathered at most two others still gathered (one computing, one
    prefetched; keeping every unit's weights from forward to backward shows as more)."""
    world_size = len(results)
    sizes = unit_sizes(reference, world_size)
    element = torch.tensor([], dtype=compute_dtype or torch.float32).element_size()
    units = len(sizes)
    gathered = 2 * steps * element * world_size * sum(shard for _, shard in sizes)
    largest_two = element * world_size * sum(sorted(shard for _, shard in sizes)[-2:])
    expected_out = str(compute_dtype or torch.float32)
    problems = []
    for rank, result in enumerate(results):
        wire = result["wire"]
        if wire["all_gathers"] != 2 * units * steps or wire["reduce_scatters"] != units * steps:
            problems.append(f"rank {rank}: {wire['all_gathers']} all-gathers and {wire['reduce_scatters']} "
                            f"reduce-scatters in {steps} steps of {units} units; expected {2 * units * steps} "
                            f"(before each unit's forward and again before its backward) and {units * steps}")
        elif wire["gathered_bytes"] != gathered:
            problems.append(f"rank {rank}: all-gathers produced {wire['gathered_bytes']} B; the units' flat "
                            f"vectors in {expected_out.removeprefix('torch.')} make {gathered} B")
        elif wire["max_live_buffers"] > 2 or wire["max_live_bytes"] > largest_two:
            problems.append(f"rank {rank}: {wire['max_live_buffers']} units' gathered weights "
                            f"({wire['max_live_bytes']} B) were still allocated when another was gathered: free "
                            "each unit's full weights after its forward and after its backward")
        elif result["output_dtype"] != expected_out:
            problems.append(f"rank {rank}: the model's output is {result['output_dtype']}, expected {expected_out}")
    return problems


def check() -> None:
    """Three steps of FSDP on 2 and 3 ranks, fp32 (with and without prefetch) and bf16, equal
    one process; each rank keeps 1/N of the weights."""
    dims = [11, 24, 30, 19, 4]
    data = make_regression(4, 24, dims[0], dims[-1])

    def model_fn():
        return unit_mlp(4, dims)

    reference = train_reference(model_fn, data, 3, 0.1)
    for world_size, prefetch in ((2, False), (3, True)):
        results = run_world(train_fsdp, world_size, model_fn, data, 3, 0.1, prefetch=prefetch)
        check_parity(results, reference, name=f"FSDP {world_size} ranks")
        problems = memory_problems(results, reference) + wire_problems(results, reference, 3)
        assert not problems, problems
    lowp = train_reference(model_fn, data, 3, 0.1, compute_dtype=torch.bfloat16, world_size=2)
    results = run_world(train_fsdp, 2, model_fn, data, 3, 0.1, compute_dtype=torch.bfloat16)
    check_parity(results, reference, name="FSDP bf16", lowp_reference=lowp)
    problems = memory_problems(results, reference) + wire_problems(results, reference, 3, torch.bfloat16)
    assert not problems, problems
    full = 4 * sum(p.numel() for p in reference.parameters())
    print(f"fsdp: fp32 and bf16 FSDP match one process; parameters per rank {results[0]['memory']['param_bytes']} B "
          f"of {full} B")


if __name__ == "__main__":
    check()
