"""Memory measured as mechanism: bytes autograd saves for backward, and the GPU's peak.

Shared by every lab that grades memory (02 fusion's ConvBN, 05 flash attention): on the CPU the
saved-tensor count is the deterministic figure; the allocator's peak exists only on a GPU.
"""

from __future__ import annotations

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
    storages: dict[tuple[str, int], int] = {}

    def note(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    for t in _ctx_tensors(out):
        note(t)
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
