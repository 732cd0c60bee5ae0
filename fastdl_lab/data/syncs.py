"""Counting what a training step makes the host wait for (lab 06 profiling).

A GPU runs ahead of the Python that feeds it only while the host never needs an answer from it.
``SyncCounter`` watches one thread (with the backward passes it runs) and counts three things, each
named after what it costs on a GPU:

``syncs``
    points where the host must wait until the device has produced a value: ``.item()``,
    ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:`` (all ``aten._local_scalar_dense``),
    ``tolist()``, ``numpy()``, ``np.asarray(t)``, printing a tensor, a copy of a device tensor to
    the CPU, and ops whose output *shape* depends on the values (``nonzero``, ``masked_select``,
    boolean-mask indexing and assignment, ``unique``, ``bincount``, ``repeat_interleave`` without
    ``output_size``, ``equal``, ``allclose``). Each one drains the launch queue: the device idles
    while Python catches up.
``ops``
    aten ops dispatched on the device: on a GPU, roughly one kernel launch each, a few
    microseconds of host time however small the tensor. A Python loop over a batch shows here.
``uploads``
    tensors made from host data (``torch.tensor(list)``, ``torch.as_tensor(ndarray)``,
    ``torch.from_numpy``: all reach the dispatcher as ``aten.lift_fresh``) that land on the
    device, and host-to-device copies. A constant rebuilt inside the loop shows up once per step;
    a batch moved to the GPU is one upload per tensor, pinned and ``non_blocking`` or not (the
    event name says which).

``events`` counts ``(kind, name)`` pairs, so a count can be traced to what caused it. The kinds are
the three above, ``"host"`` (reads and host-data tensors that do not count, see below) and
``"host ops"`` (ops that never touch the device; only when the device is not the CPU).

**On the CPU the device is the CPU** (``device="cpu"``, the default without a GPU). Every tensor
then counts as a device tensor: a read of its value is a sync because it would be one on a GPU, and
every tensor made from host data is an upload. One exception keeps the emulation faithful: reads and
host-data tensors made by ``torch.utils.data``'s own code in this thread (the sampler's shuffled
indices, the loader's worker seed, ``default_collate``) are host bookkeeping on a GPU too, so they
are filed under the kind ``"host"`` and not counted. With a GPU (``device="cuda"``) the device
decides: reads and host-data tensors on the CPU are ``"host"`` events and CPU-only ops ``"host ops"``,
not syncs, uploads or ops.

Limits: only this thread is watched (DataLoader workers and the pin-memory thread are not, which
is the point of moving work there); synchronisations outside tensors (``torch.cuda.synchronize``,
``Event.synchronize``) are not counted, nor are syncs made inside an op's C++ implementation; a
read buried inside another torch Python function reaches only the dispatcher's view (a sync op
still counts; a ``tolist`` there does not); code that disables or pops modes escapes counting
(``intact`` tells whether this counter's modes were still in place at exit).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from fastdl_lab import device as _device

aten = torch.ops.aten

# Ops whose result needs a value from the device before the host can go on.
_SYNC_OPS = {
    aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2,
    aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive, aten.bincount,
    aten.equal, aten.allclose,
}
# Indexing syncs only when an index is a mask: the output size is the number of True values.
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_MASK_DTYPES = (torch.bool, torch.uint8)
_COPY_OPS = {aten._to_copy, aten.copy_}
_ROLES: dict[int, tuple] = {}


def _role(func) -> tuple[str, str | None]:
    """An op's printable name and what it means here, worked out once per op (ops are singletons)."""
    known = _ROLES.get(id(func))
    if known is None:
        packet = func.overloadpacket
        role = ("sync" if packet in _SYNC_OPS else "mask" if packet in _INDEX_OPS
                else "sized" if func is aten.repeat_interleave.Tensor else "lift" if packet is aten.lift_fresh
                else "copy" if packet in _COPY_OPS else None)
        # The op is kept alive beside its id, so the id cannot be reused by another object.
        known = _ROLES[id(func)] = (str(func), role, func)
    return known[0], known[1]


# Value reads that never reach the dispatcher (or reach it only as harmless detaches).
_READS = {
    torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__, torch.Tensor.__repr__,
    torch.Tensor.__str__, torch.Tensor.__format__,
}
_READ_NAMES = {f: f"Tensor.{f.__name__}" for f in _READS}

_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_LOADER_DIR = os.path.dirname(os.path.abspath(torch.utils.data.__file__)) + os.sep


def _caller_is_loader() -> bool:
    """Whether the code that triggered the current event belongs to ``torch.utils.data``.

    Frames of this module and of torch's other internals (mode plumbing, wrappers, functional
    code) are passed over: what counts is who asked for them.
    """
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_LOADER_DIR):
            return True
        if path != _HERE and not path.startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counter._dispatched(func, args, kwargs, out)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _READS:
            return func(*args, **kwargs)
        counter = self.counter
        counter._read(_READ_NAMES[func], args[0] if args else None)
        # Whatever the read dispatches underneath (a detach, a copy to the CPU, an item) is the
        # same wait; it must not be counted a second time.
        counter._reading += 1
        try:
            return func(*args, **kwargs)
        finally:
            counter._reading -= 1


class SyncCounter:
    """Context manager counting ``syncs``, ``ops`` and ``uploads`` made in this thread.

    ``device``: the device whose values count (default ``"cuda"`` when a GPU is present, else
    ``"cpu"``, the emulation described in the module docstring). Nothing is changed: every op runs
    as it would, with the same inputs and outputs. Re-entering an active counter is an error;
    distinct counters nest, and each sees everything inside it.
    """

    def __init__(self, device: str | torch.device | None = None):
        if device is None:
            device = "cuda" if _device.has_gpu() else "cpu"
        self.device = torch.device(device)
        self.syncs = self.ops = self.uploads = 0
        self.events: Counter = Counter()
        self.intact = True
        self._reading = 0
        self._emulating = self.device.type == "cpu"
        self._active = False
        self._function, self._dispatch = _Function(self), _Dispatch(self)

    # --- entering and leaving ------------------------------------------------------------
    def __enter__(self) -> SyncCounter:
        if self._active:
            raise RuntimeError("this SyncCounter is already active; make a new one to nest")
        self._depths = (len(_get_current_function_mode_stack()), len(_get_current_dispatch_mode_stack()))
        self._function.__enter__()
        try:
            self._dispatch.__enter__()
        except BaseException:
            self._function.__exit__(None, None, None)
            raise
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._active = False
        function_depth, dispatch_depth = self._depths
        # Modes pushed inside and never popped are dropped, and a mode of ours that someone
        # removed is put back just long enough to leave properly: the stacks end as they began.
        ok = self._unwind(_get_current_dispatch_mode_stack, dispatch_depth, self._dispatch, _pop_mode, _push_mode)
        self._dispatch.__exit__(None, None, None)
        ok &= self._unwind(_get_current_function_mode_stack, function_depth, self._function,
                           torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack)
        self._function.__exit__(None, None, None)
        self.intact = self.intact and ok
        return False

    @staticmethod
    def _unwind(stack, depth, mine, pop, push) -> bool:
        modes = stack()
        ok = len(modes) == depth + 1 and modes[depth] is mine
        if not ok:
            while len(stack()) > depth:
                pop()
            push(mine)
        return ok

    # --- what the modes report -------------------------------------------------------------
    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device.type

    def _note(self, kind: str, name: str) -> None:
        self.events[kind, name] += 1
        if kind == "syncs":
            self.syncs += 1
        elif kind == "uploads":
            self.uploads += 1

    def _read(self, name: str, tensor) -> None:
        if self._reading:
            return
        if self._emulating:
            device_value = not _caller_is_loader()
        else:
            device_value = isinstance(tensor, torch.Tensor) and self._on_device(tensor)
        self._note("syncs" if device_value else "host", name)

    def _dispatched(self, func, args, kwargs, out) -> None:
        name, role = _role(func)
        if self._emulating:
            on_device = True
        else:
            on_device = any(self._on_device(t) for t in _tensors(args)) or any(
                self._on_device(t) for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)))
        if on_device:
            self.ops += 1
            self.events["ops", name] += 1
        else:
            self.events["host ops", name] += 1
        if role is None:
            return

        if role == "copy":
            if self._emulating:
                return
            src, dst = (args[1], args[0]) if func.overloadpacket is aten.copy_ else (args[0], out)
            how = " (non_blocking)" if kwargs.get("non_blocking") or (len(args) > 2 and args[2]) else ""
            if self._on_device(dst) and src.device.type == "cpu":
                self._note("uploads", f"h2d {name}{how}")
            elif self._on_device(src) and dst.device.type == "cpu" and not self._reading:
                self._note("syncs", f"d2h {name}{how}")
            return
        if role == "lift":
            kind = "uploads"
        elif (role == "sync" or (role == "mask" and any(i.dtype in _MASK_DTYPES for i in _tensors(args[1])))
              or (role == "sized" and kwargs.get("output_size") is None)):
            if self._reading:
                return
            kind = "syncs"
        else:
            return
        if self._emulating:
            on_device = not _caller_is_loader()
        self._note(kind if on_device else "host", name)

    # --- results ------------------------------------------------------------------------------
    def report(self, steps: int | None = None) -> str:
        """The three counts (per step when ``steps`` is given) and the events behind each."""
        def figure(count: int) -> str:
            return f"{count}" if not steps else f"{count} ({count / steps:.1f}/step)"

        lines = [f"on {self.device.type}: syncs {figure(self.syncs)}, ops {figure(self.ops)}, "
                 f"uploads {figure(self.uploads)}" + ("" if self.intact else "  [modes were tampered with]")]
        for kind in ("syncs", "uploads", "ops", "host", "host ops"):
            top = sorted(((n, name) for (k, name), n in self.events.items() if k == kind), reverse=True)
            if top:
                shown = ", ".join(f"{name} x{n}" for n, name in top[:8])
                more = f", ... {len(top) - 8} more" if len(top) > 8 else ""
                lines.append(f"  {kind}: {shown}{more}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SyncCounter(device={self.device.type!r}, syncs={self.syncs}, ops={self.ops}, uploads={self.uploads})"
