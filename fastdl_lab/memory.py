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

    Counting rule: every tensor saved for backward is seen through a saved-tensors hook, and each
    distinct storage it lives in counts once, whole. Inputs and parameters saved by reference
    count (backward needs them kept), a tensor saved by two ops counts once (it is one buffer),
    and a saved view counts its whole storage (it keeps all of it alive).
    """
    storages: dict[tuple[str, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(storages.values())


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
