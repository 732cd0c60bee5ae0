"""Fully sharded data parallelism (ZeRO stage 3, PyTorch's FSDP) from scratch (lab 07).

ZeRO-1 (``zero``) shards the optimizer state; every rank still holds every weight. FSDP shards
the weights too. The model is cut into *units* (here: the blocks of an ``nn.Sequential``); each
unit's parameters are flattened into one vector, padded to a multiple of the world size N, and
rank r keeps only the r-th of N equal pieces: its **shard**. As in torch's FSDP with
``use_orig_params=True``, the parameters keep their names and owners: each is registered where it
was, as a 1-D view of the part of this rank's shard that falls inside it (empty where the
parameter lies in other ranks' shards), and the optimizer steps on those views; names differ
from the unwrapped model's only by the wrapper's ``_fsdp_wrapped_module.`` (``clean_name``). A
parameter tied between two layers of one unit is flattened once and both layers see the same
view; ties across units are refused, as torch's FSDP requires them in one unit. A unit's full
weights exist only while that unit computes:

1. before the unit's forward, an **all-gather** of the shards rebuilds the flat vector, and the
   layers' weights become views into it;
2. after the forward, the vector's storage is **freed** (``untyped_storage().resize_(0)``): the
   autograd graph still refers to the views, so dropping a Python reference would free nothing;
3. when backward reaches the unit, a hook on its output **re-gathers** into the same storage, so
   the tensors autograd saved become valid again, and the layers hold full views once more;
4. after the unit's backward, the gradient of the flat vector is **reduce-scattered** (each rank
   receives the sum of everyone's gradient for its own shard), divided by N, and handed to the
   parameters' views as their ``.grad`` (views of it, as the parameters are of the shard); the
   storage is freed again and the layers hold their sharded parameters.

While a unit computes, forward or backward, its layers' attributes are plain full-shape views of
the gathered vector; at every other time they are the registered sharded parameters (torch's
FSDP swaps its registrations the same way).

A rank therefore holds 1/N of the parameters, gradients and optimizer state, plus one unit's full
weights at a time; the price is one more all-gather per unit and step than ZeRO-1's traffic
(Rajbhandari et al., 2020; Zhao et al., *PyTorch FSDP*, VLDB 2023). With ``compute_dtype`` the
shards stay fp32 *master* weights while the gathers, and the unit's arithmetic, are bf16; only
floating-point inputs are cast (an embedding's token ids stay integers), and without a
``compute_dtype`` no input is touched.

``train_fsdp`` is the trusted loop: it builds the units with any class that follows
``FSDPUnit``'s protocol, trains with SGD on the model's parameters, and measures what the rank
holds and what crossed the wire itself (``census``), never trusting a number the unit reports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

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

WRAPPED = "_fsdp_wrapped_module"  # the unit's attribute for its module, as torch's FSDP names it


class Slot(NamedTuple):
    """One parameter of a unit: every ``(submodule, attribute)`` that holds it (two or more for a
    tied weight), its shape, and where it starts in the unit's flat vector."""

    owners: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def clean_name(name: str) -> str:
    """A parameter's name with the units' wrapper segments taken out: ``0._fsdp_wrapped_module.0.weight``
    is ``0.0.weight``, the unwrapped model's name."""
    return ".".join(part for part in name.split(".") if part != WRAPPED)


def flat_layout(module: nn.Module, world_size: int) -> tuple[list[Slot], int, int]:
    """Where each parameter of ``module`` lives in its unit's flat vector.

    Returns ``(slots, numel, shard_size)``: one ``Slot`` per distinct parameter in
    ``named_parameters()`` order, with every owner of a tied one; the total number of elements;
    and the elements per shard, ``ceil(numel / world_size)``. The flat vector is the parameters'
    ``reshape(-1)`` one after another, then zeros up to ``shard_size * world_size``; rank r's shard
    is elements ``r * shard_size`` to ``(r + 1) * shard_size``.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    order: list[torch.Tensor] = []
    for name, p in module.named_parameters(remove_duplicate=False):
        owner_name, _, attr = name.rpartition(".")
        if id(p) not in owners:
            owners[id(p)] = []
            order.append(p)
        owners[id(p)].append((module.get_submodule(owner_name), attr))
    slots, numel = [], 0
    for p in order:
        slots.append(Slot(tuple(owners[id(p)]), p.shape, numel))
        numel += p.numel()
    if numel == 0:
        raise ValueError("a unit needs at least one parameter to shard")
    return slots, numel, math.ceil(numel / world_size)


def check_no_ties_across(units: Sequence[nn.Module]) -> None:
    """Refuse a model whose units share a parameter: each unit shards its own flat vector, so a
    weight in two units would be two weights after the first step (torch's FSDP refuses it too)."""
    seen: dict[int, int] = {}
    for u, unit in enumerate(units):
        for name, p in unit.named_parameters():
            if seen.setdefault(id(p), u) != u:
                raise ValueError(f"parameter {name!r} of unit {u} is also in unit {seen[id(p)]}: tied weights "
                                 "must be in one unit")


def _checked_slot(slot) -> None:
    if not isinstance(slot, Slot):
        raise TypeError(f"a slot is a fsdp.Slot from flat_layout, not {slot!r}")
    for owner, name in slot.owners:
        if not isinstance(owner, nn.Module) or not isinstance(name, str) or not name.isidentifier() \
                or name.startswith("_"):
            raise TypeError(f"a slot's owners are (submodule, public attribute name), not ({owner!r}, {name!r})")


def _unset(owner: nn.Module, name: str) -> None:
    """Remove ``owner.<name>``, whether a registered parameter or a plain attribute."""
    owner._parameters.pop(name, None)
    owner.__dict__.pop(name, None)


def drop_parameters(slots: Sequence[Slot]) -> None:
    """Remove each slot's parameter from every submodule that holds it."""
    for slot in slots:
        _checked_slot(slot)
        for owner, name in slot.owners:
            if name not in owner._parameters:
                raise ValueError(f"{type(owner).__name__} has no parameter {name!r} to drop")
            _unset(owner, name)


def place_views(slots: Sequence[Slot], full: torch.Tensor) -> None:
    """Point every owner's attribute at its piece of the flat vector ``full`` (views: no copy),
    in place of the sharded parameter registered there."""
    for slot in slots:
        _checked_slot(slot)
        view = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        for owner, name in slot.owners:
            _unset(owner, name)
            setattr(owner, name, view)


def sharded_parameters(slots: Sequence[Slot], shard: torch.Tensor, start: int) -> list[nn.Parameter]:
    """One parameter per slot: the 1-D part of ``shard`` (this rank's piece of the flat vector,
    beginning at element ``start``) inside that slot's range, possibly empty; each shares
    ``shard``'s memory, so a step on it is a step on the shard."""
    data, params = shard.detach(), []
    for slot in slots:
        lo = min(max(slot.offset - start, 0), len(data))
        hi = min(max(slot.offset + slot.numel - start, 0), len(data))
        params.append(nn.Parameter(data[lo:hi]))
    return params


def register_sharded(slots: Sequence[Slot], params: Sequence[nn.Parameter]) -> None:
    """Register each slot's sharded parameter with every owner, under the parameter's own name."""
    for slot, param in zip(slots, params, strict=True):
        _checked_slot(slot)
        for owner, name in slot.owners:
            _unset(owner, name)
            owner.register_parameter(name, param)


def grads_to_parameters(shard: torch.Tensor, slots: Sequence[Slot], params: Sequence[nn.Parameter],
                        start: int) -> None:
    """After the backward put the shard's gradient on the parameters: each gets the view of it
    that matches its own view of the shard, and the shard's own ``.grad`` is let go, so that the
    next backward starts from nothing."""
    grad, shard.grad = shard.grad, None
    if grad is None:
        return
    for slot, param in zip(slots, params, strict=True):
        lo = min(max(slot.offset - start, 0), len(grad))
        grad_view = grad[lo:lo + param.numel()]
        param.grad = grad_view if param.grad is None else param.grad + grad_view


def cast_floating(x, dtype: torch.dtype | None):
    """``x`` (a tensor, or tuples, lists and dicts of them) with its floating-point tensors cast to
    ``dtype``; integer tensors (token ids) and everything with ``dtype`` None are left as they are."""
    if dtype is None:
        return x
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(cast_floating(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: cast_floating(v, dtype) for k, v in x.items()}
    return x


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
    """One unit of a fully sharded model: ``module``'s parameters live as views of this rank's shard.

    The protocol ``train_fsdp`` relies on: ``FSDPUnit(module, compute_dtype=None)`` is built on
    every rank from identical modules; ``shard`` (fp32, ``shard_size`` elements, laid out as in
    ``flat_layout``) holds this rank's part of the weights, and the unit's parameters are the
    module's own, under their own names (``clean_name``), as views of it; after the backward each
    parameter's ``.grad`` is the matching part of the averaged gradient; ``forward(x)`` returns
    the module's output (in ``compute_dtype`` when given). ``next_unit``, when set, is the unit
    that runs next: its all-gather is started while this one computes (prefetch).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        setattr(self, WRAPPED, module)  # torch's FSDP's name for it; clean_name drops it
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.slots, self.numel, self.shard_size = flat_layout(module, self.world_size)
        flat = flatten_padded([p for p in module.parameters()], self.shard_size * self.world_size)
        self.start = self.rank * self.shard_size
        # The rank's storage of the weights; its gradient arrives here and moves to the parameters.
        self.shard = flat[self.start:self.start + self.shard_size].float().clone().requires_grad_()
        self.compute_dtype = compute_dtype
        self.full = torch.empty(self.shard_size * self.world_size, dtype=compute_dtype or torch.float32,
                                device=flat.device)
        free_storage(self.full)
        drop_parameters(self.slots)
        self.params = sharded_parameters(self.slots, self.shard, self.start)
        register_sharded(self.slots, self.params)  # the module's own names, views of the shard
        self.shard.register_post_accumulate_grad_hook(
            lambda shard: grads_to_parameters(shard, self.slots, self.params, self.start))
        self.next_unit: FSDPUnit | None = None
        self._pending = None

    @property
    def module(self) -> nn.Module:
        return getattr(self, WRAPPED)

    def gather(self, async_op: bool = False) -> None:
        """All-gather the shards into ``full`` (its storage re-allocated first)."""
        ### BEGIN SOLUTION
        pending, self._pending = self._pending, None
        if pending is not None:  # started by the previous unit's forward
            pending.wait()
            return
        allocate_storage(self.full)
        work = dist.all_gather_single(self.full, self.shard.detach().to(self.full.dtype), async_op=async_op)
        if async_op:
            self._pending = work
        ### END SOLUTION

    def free(self) -> None:
        """Release the full weights' memory; the layers hold their sharded parameters again."""
        free_storage(self.full)
        register_sharded(self.slots, self.params)

    def use_views(self, full: torch.Tensor) -> None:
        """Point every layer's weight at its piece of ``full`` (views: no copy)."""
        place_views(self.slots, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        full = _GatherParams.apply(self.shard, self)
        if self.next_unit is not None:
            self.next_unit.gather(async_op=True)
        self.use_views(full)
        out = self.module(cast_floating(x, self.compute_dtype))
        self.free()
        if out.requires_grad:
            out.register_hook(self.before_backward)
        return out
        ### END SOLUTION

    def before_backward(self, grad: torch.Tensor) -> None:
        ### BEGIN SOLUTION
        self.gather()
        # Autograd's saved views see the weights again through the storage; the layers are
        # pointed at the full vector too, so that what reads them during the unit's backward
        # (a hook, a recomputed forward) finds full weights, as torch's FSDP registers them.
        self.use_views(self.full)
        ### END SOLUTION


def link_prefetch(units: Sequence[nn.Module]) -> None:
    """Let each unit start the next one's all-gather during its own forward. The link is a plain
    attribute, not a submodule: as a submodule the next unit's parameters would be listed, and
    named, under this one."""
    for unit, following in zip(units, units[1:]):
        object.__setattr__(unit, "next_unit", following)


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


class TiedEmbeddingBlock(nn.Module):
    """Token ids to features through an embedding, then back to one score per vocabulary entry
    through a projection that *is* the embedding's matrix (tied, as a language model's output
    layer): ``tanh(mean over tokens of E[ids]) @ E.T + b``. The two uses of ``E`` live in one unit."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.project = nn.Linear(width, vocab)
        self.project.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.project(torch.tanh(self.embed(ids).mean(dim=1)))


def unit_lm(seed: int, vocab: int, width: int, hidden: int, out: int) -> nn.Sequential:
    """A model fed token ids, as units: a ``TiedEmbeddingBlock`` (an embedding and the projection
    tied to it), Linear + Tanh from the vocabulary's scores to ``hidden``, a last Linear to ``out``."""
    model = nn.Sequential(TiedEmbeddingBlock(vocab, width), nn.Sequential(nn.Linear(vocab, hidden), nn.Tanh()),
                          nn.Sequential(nn.Linear(hidden, out)))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(checks.randn(p.shape, seed=seed * 100 + i, scale=p.shape[-1] ** -0.5))
    return model


def make_token_data(seed: int, n: int, tokens: int, vocab: int, out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of ``tokens`` token ids (int64) and a target of ``out`` values each."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, tokens), generator=gen), torch.randn(n, out, generator=gen)


def _run_units(blocks, x: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    if compute_dtype is None:
        return blocks(x)
    # Mixed precision as FSDP does it: each unit's fp32 weights cast for its own computation, and
    # its floating-point inputs (never its token ids).
    for block in blocks:
        weights = {name: p.to(compute_dtype) for name, p in block.named_parameters()}
        x = torch.func.functional_call(block, weights, (cast_floating(x, compute_dtype),))
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
    steps on the units' parameters. Returns this rank's pieces of the parameters by name
    (``named_pieces``) and what
    ``census`` measured: collectives, the most gathered weights alive at once, and after the
    last step the bytes of the shards, of their gradients, and of every tensor this training
    left alive in the process apart from the data and the optimizer's state (``resident_bytes``).
    """
    x, y = _shard(data, rank, world_size)
    with census.snapshot() as before:
        with census.sharded_collectives() as wire:
            blocks = list(model_fn())
            check_no_ties_across(blocks)
            units = [unit_cls(block.to(rank_device()), compute_dtype=compute_dtype) for block in blocks]
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
            "foreign_params": foreign_parameters(model),
        }
    return {"params": named_pieces(model), "memory": memory, "wire": wire.summary(), "output_dtype": out_dtype}


def foreign_parameters(model: nn.Sequential) -> list[str]:
    """The clean names of the units' parameters that do not live in their own unit's ``shard``.

    Names alone do not make FSDP: a parameter registered under its name as a copy of its piece
    of the shard is a second copy of the weights, the optimizer steps on it and not on what the
    gathers read, and the memory per rank is no longer 1/N. Each must be a view of the shard
    (an empty one where the parameter lies in other ranks' shards)."""
    found = []
    for prefix, unit in model.named_children():
        shard = getattr(unit, "shard", None)
        found += [clean_name(name) for name, p in unit.named_parameters(prefix=prefix)
                  if not census.shares_storage(p, shard)]
    return found


def named_pieces(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter of the wrapped model by its clean name: this rank's piece of it."""
    return {clean_name(name): p.detach().clone() for name, p in model.named_parameters()}


# --- checks, in the parent ----------------------------------------------------------------------

def unit_sizes(model: nn.Sequential, world_size: int) -> list[tuple[int, int]]:
    """(numel, shard_size) of every unit of ``model`` over ``world_size`` ranks."""
    return [flat_layout(block, world_size)[1:] for block in model]


def rank_elements(model: nn.Sequential, world_size: int, rank: int) -> int:
    """How many of the model's elements fall in ``rank``'s shards (its shards less their padding)."""
    return sum(max(0, min(numel, (rank + 1) * shard) - rank * shard) for numel, shard in unit_sizes(model, world_size))


def gather_parameters(results: list[dict], reference: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights the ranks' pieces put together, by ``reference.named_parameters()``'s names.

    Each rank must name its parameters as the unwrapped model does (``clean_name``): torch's FSDP
    with ``use_orig_params=True`` keeps names and owners, and code that finds a layer's weights by
    name depends on it. Rank r's piece of a parameter is its part of r's shard, so the pieces, in
    rank order, are the parameter."""
    names = [name for name, _ in reference.named_parameters()]
    for rank, result in enumerate(results):
        got = result.get("params") if isinstance(result, dict) else None
        if not isinstance(got, dict) or sorted(got) != sorted(names):
            shown = sorted(got)[:6] if isinstance(got, dict) else type(got).__name__
            raise checks.MismatchError(f"rank {rank}'s parameters are named {shown}; the model's own names are "
                                       f"{names[:6]}{' ...' if len(names) > 6 else ''}: keep each parameter where it "
                                       "was, under its own name, as a view of the shard")
    weights = {}
    for name, p in reference.named_parameters():
        pieces = [result["params"][name] for result in results]
        if any(not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32 for t in pieces):
            shown = [f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__ for t in pieces]
            raise checks.MismatchError(f"{name}: the ranks' pieces are {shown}; each is a 1-D float32 view of the "
                                       "rank's shard")
        flat = torch.cat(pieces)
        if flat.numel() != p.numel():
            raise checks.MismatchError(f"{name}: the ranks' pieces hold {[t.numel() for t in pieces]} elements, "
                                       f"{flat.numel()} in all; the parameter has {p.numel()}")
        weights[name] = flat.view_as(p)
    return weights


def check_parity(results: list[dict], reference: nn.Sequential, name: str = "FSDP",
                 lowp_reference: nn.Sequential | None = None) -> None:
    """The weights the pieces make equal the single-process ones: to fp32 rounding, or, given
    ``lowp_reference`` (``train_reference`` with bf16 units and the ranks' slices), no further
    from the fp32 ``reference`` than twice that run's own error."""
    try:
        got = gather_parameters(results, reference)
    except checks.MismatchError as exc:
        raise checks.MismatchError(f"{name} {exc}") from None
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

    A rank's parameters must be views of its units' shards (``foreign_parameters``); it must hold
    its fp32 shards (exactly their bytes), the optimizer's momentum for its elements (exactly
    their bytes: the loop leaves that state out of the count, so nothing may hide there), and the
    gradients; anything else that stays alive may add at most half of the shards and gradients
    again.
    """
    world_size = len(results)
    shard_bytes = 4 * sum(shard for _, shard in unit_sizes(reference, world_size))
    full_bytes = 4 * sum(p.numel() for p in reference.parameters())
    problems = []
    for rank, result in enumerate(results):
        mem = result["memory"]
        state_bytes = 4 * rank_elements(reference, world_size, rank)
        if mem["foreign_params"]:
            foreign = mem["foreign_params"]
            problems.append(f"rank {rank}: parameters that are not views of their unit's shard but tensors of "
                            f"their own: {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} "
                            f"({len(foreign)}); the optimizer must step on the shard, through views of it "
                            "(fsdp.sharded_parameters)")
        elif mem["param_bytes"] != shard_bytes:
            problems.append(f"rank {rank} optimises {mem['param_bytes']} B of parameters; its fp32 shards are "
                            f"{shard_bytes} B (the whole model: {full_bytes} B)")
        elif mem["state_bytes"] != state_bytes:
            problems.append(f"rank {rank}: the optimizer's state is {mem['state_bytes']} B; momentum for the "
                            f"rank's {state_bytes // 4} elements is {state_bytes} B")
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
    # Token ids through an embedding whose matrix is also the projection: the ids stay integers
    # under bf16, and the names are the model's own.
    lm = functools.partial(unit_lm, 5, 23, 10, 14, 3)
    lm_data = make_token_data(5, 12, 6, 23, 3)
    lm_reference = train_reference(lm, lm_data, 3, 0.1)
    for world_size, dtype in ((3, None), (2, torch.bfloat16)):
        results = run_world(train_fsdp, world_size, lm, lm_data, 3, 0.1, compute_dtype=dtype)
        lowp = train_reference(lm, lm_data, 3, 0.1, compute_dtype=dtype, world_size=world_size) if dtype else None
        check_parity(results, lm_reference, name=f"FSDP tied embedding {world_size} ranks", lowp_reference=lowp)
        problems = memory_problems(results, lm_reference) + wire_problems(results, lm_reference, 3, dtype)
        assert not problems, problems
    print(f"fsdp: fp32 and bf16 FSDP match one process, with an MLP and with a tied embedding; parameters per rank "
          f"{results[0]['memory']['param_bytes']} B of {4 * sum(p.numel() for p in lm_reference.parameters())} B, "
          f"under their own names")


if __name__ == "__main__":
    check()
