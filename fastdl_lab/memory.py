"""Memory measured as mechanism: bytes autograd saves for backward, what a function keeps and
creates, and the GPU's peak; and what a memory pool saves (``fresh_vs_reused``,
``caching_allocator_steps``).

Shared by every lab that grades memory (02 fusion's ConvBN, 05 flash attention): on the CPU the
saved-tensor count and ``footprint``'s figures are deterministic; the allocator's peak exists only
on a GPU.
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import dataclass
from typing import Callable

import torch

from fastdl_lab import device


def saved_tensor_bytes(fn: Callable, *args) -> int:
    """Bytes that autograd keeps for backward while ``fn(*args)`` runs (forward only).

    Counting rule: every tensor saved for backward is seen through a saved-tensors hook, and so is
    every tensor a custom ``autograd.Function`` keeps as an attribute of its ``ctx`` (the graph is
    walked for them: ``ctx.s = scores`` keeps the scores alive as surely as
    ``save_for_backward`` does). Each distinct storage counts once, whole. Inputs and parameters
    saved by reference count (backward needs them kept), a tensor saved by two ops counts once
    (it is one buffer), and a saved view counts its whole storage (it keeps all of it alive).
    """
    out, storages = _saved_storages(fn, args)
    del out
    return sum(storages.values())


def _held(value, depth: int = 0):
    """Tensors inside a ctx attribute: directly, or in lists, tuples, dicts and objects' fields."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _held(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _held(v, depth + 1)
    elif depth < 4 and hasattr(value, "__dict__") and not isinstance(value, type):
        for v in vars(value).values():
            yield from _held(v, depth + 1)


def _ctx_tensors(out):
    """Tensors held as attributes of the custom-Function nodes of ``out``'s graph."""
    roots = [t.grad_fn for t in _held(out) if t.grad_fn is not None]
    seen, todo = set(), roots
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        # A custom Function's backward node is its ctx: attributes set in forward live there.
        yield from _held(getattr(node, "__dict__", {}))
        todo.extend(next_node for next_node, _ in node.next_functions)


def peak_memory_bytes(fn: Callable, *args) -> int | None:
    """GPU memory in use at the peak of ``fn(*args).sum().backward()``, above what was in use before.

    None without a GPU: the CPU allocator keeps no peak statistics; ``saved_tensor_bytes`` is the
    deterministic figure there.
    """
    if not device.has_gpu():
        return None
    device.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*args).sum().backward()
    device.synchronize()
    return torch.cuda.max_memory_allocated() - before


@dataclass(frozen=True)
class Footprint:
    """What one forward and backward of a differentiable function kept and created (``footprint``)."""

    saved_bytes: int  # by saved_tensor_bytes's rule: saved for backward, or held by a ctx
    kept_bytes: int  # tensors the forward created that are still alive once it has returned, held anywhere
    python_bytes: int  # Python memory the forward allocated and has not freed (numbers kept in lists, ...)
    largest_elements: int  # the largest tensor any operation of the forward or backward created
    largest_shape: tuple[int, ...]
    largest_phase: str  # "forward" or "backward"


def footprint(fn: Callable, *args, grad_out: torch.Tensor | None = None):
    """Run ``out = fn(*args)`` and its backward once, counting; returns ``(out, grads, Footprint)``.

    ``args`` are the tensors that require grad; ``grads`` are their gradients for ``grad_out``
    (ones by default). The saved bytes follow ``saved_tensor_bytes``. The kept bytes count every
    storage an operation of the forward created that is still alive after it (after a garbage
    collection): wherever the function hides a tensor, a ctx attribute, a global list or a default
    argument, it is counted. The Python bytes are tracemalloc's count of what the forward left
    allocated (tensors' data is not Python memory). The largest tensor is over every operation of
    both passes, by the elements of its storage: a tiled algorithm never creates an N x N one.
    """
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    existing = {_storage_key(t) for t in args if isinstance(t, torch.Tensor)}
    made: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}
    largest = [0, (), ""]
    phase = ["forward"]

    def note(t: torch.Tensor) -> None:
        if t.layout != torch.strided:
            raise ValueError(f"a {t.layout} tensor: only strided tensors are counted, so none may be created here")
        storage = t.untyped_storage()
        elements = storage.nbytes() // t.element_size()
        if elements > largest[0]:
            largest[:] = [elements, tuple(t.shape), phase[0]]
        key = _storage_key(t)
        if phase[0] == "forward" and storage.nbytes() and key not in existing:
            known = made.get(key)
            if known is None or known[0].expired():
                made[key] = (StorageWeakRef(storage), storage.nbytes())

    class Created(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # Else the first dispatch imports torch._dynamo (seconds) only to keep it out of this
            # method, and nothing here is compiled.
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in _held(out):
                note(t)
            return out

    # The first operation dispatched through a Python mode imports and caches torch's machinery for
    # it: done here, before tracemalloc counts (and slows) anything.
    with Created():
        torch.zeros(1).add_(1)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    # Frozen objects are left out of collections: the one after the forward (which frees what only
    # a reference cycle holds) then scans only the forward's objects, not all of torch's.
    gc.freeze()
    try:
        python_before = _python_bytes()
        with Created():
            out, saved = _saved_storages(fn, args)
        gc.collect()
        python_bytes = max(0, _python_bytes() - python_before)
    finally:
        gc.unfreeze()
        if not tracing:
            tracemalloc.stop()
    kept = sum(nbytes for ref, nbytes in made.values() if not ref.expired())
    phase[0] = "backward"
    with Created():
        # A scalar loss rather than grad_outputs: autograd's check of an explicit output gradient
        # imports sympy, seconds in a fresh process.
        loss = out.sum() if grad_out is None else (out * grad_out).sum()
        grads = torch.autograd.grad(loss, args)
    figures = Footprint(sum(saved.values()), kept, python_bytes, largest[0], tuple(largest[1]), largest[2])
    return out.detach(), grads, figures


def _python_bytes() -> int:
    """Python memory traced now, less ``footprint``'s own bookkeeping (its records and weak references)."""
    from torch.multiprocessing import reductions

    own = [tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, reductions.__file__)]
    return sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(own).statistics("filename"))


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _saved_storages(fn: Callable, args) -> tuple:
    """``fn(*args)`` and {storage: bytes} of what it saves for backward, by saved_tensor_bytes's rule."""
    storages: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    for t in _ctx_tensors(out):
        storages[_storage_key(t)] = t.untyped_storage().nbytes()
    return out, storages


def fresh_vs_reused(megabytes: float, reps: int = 15):
    """The cost of a fresh output buffer: ``torch.add(a, b)`` (a new tensor each call) A/B-timed
    against ``torch.add(a, b, out=buffer)`` (the same buffer every call), on float32 vectors of
    ``megabytes``. On the CPU glibc's malloc serves blocks up to its mmap threshold (32 MiB at most)
    from memory it keeps, a pool; above it every call maps fresh pages from the kernel and faults
    on each as the sum first writes it. Returns ``timing.compare``'s ``Comparison`` (candidate:
    fresh, baseline: reused), in one thread."""
    from fastdl_lab import timing

    n = int(megabytes * (1 << 20)) // 4
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    buffer = torch.empty(n)
    return timing.compare(lambda: torch.add(a, b), lambda: torch.add(a, b, out=buffer), reps=reps, threads=1)


def caching_allocator_steps(steps: int = 5, megabytes: int = 64) -> list[dict] | None:
    """On a GPU: a training-like loop whose temporary (``megabytes`` a step, freed at the step's end)
    sits beside a persistent tensor; per step the bytes tensors hold (``allocated``), the bytes the
    caching allocator has taken from the driver (``reserved``) and how many times it has called
    ``cudaMalloc`` so far (``driver_mallocs``). None without a GPU."""
    if not device.has_gpu():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    n = megabytes * (1 << 20) // 4
    persistent = torch.zeros(n, device="cuda")
    rows = []
    for _ in range(steps):
        temporary = torch.randn(n, device="cuda")
        persistent += temporary
        del temporary
        stats = torch.cuda.memory_stats()
        rows.append({"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                     "driver_mallocs": stats.get("segment.all.allocated", 0) - before})
    del persistent
    return rows
