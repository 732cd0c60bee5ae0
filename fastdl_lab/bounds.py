"""Checked Triton interpreter: an out-of-bounds load or store raises a Python exception.

Under ``TRITON_INTERPRET=1`` a kernel's pointers are raw host addresses; a load or store past the
end of a tensor (a forgotten mask) reads or writes whatever lies there, and a store can kill the
process (a Jupyter kernel dies with no explanation). With this module installed, every launch of an
interpreted kernel runs on padded copies of its tensor arguments, each storage between guard bands
at least as large as itself, and every load, store and atomic checks its active (unmasked) pointers
against the storages of the launch's tensor arguments before it touches memory. A pointer outside
all of them raises ``OutOfBoundsAccess`` naming the kernel, the argument, the element offset and the
program (an address beyond every guard band, a wild offset, names no argument: which storage lies
nearest is up to the allocator); nothing has been written by then. The guard bands keep separately allocated tensors far
apart, so that a pointer run past one tensor does not land inside the next one and go unseen.

``fastdl_lab.device`` installs it whenever the interpreter is on (``FASTDL_CHECK_BOUNDS=0`` leaves
it off); ``unchecked()`` turns it off for a block, e.g. a benchmark. What it cannot see: a pointer
that leaves its own tensor for another argument's storage further away than the guard band, and
tensor-descriptor loads and stores (``tl.make_tensor_descriptor``), which it leaves unchecked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref

import numpy as np
import torch

CHECK_VAR = "FASTDL_CHECK_BOUNDS"
INTERPRETER_MODULE = "triton.runtime.interpreter"
_GUARD_MIN_BYTES = 4096
_ALIGN = 64  # keeps every view's storage offset a whole number of elements


class OutOfBoundsAccess(IndexError):
    """A Triton kernel under the interpreter used a pointer outside every tensor it was given."""


class _Launch:
    """The tensor storages of one kernel launch: the padded host copies the kernel runs on."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        # start, end, near (bytes: an address that close outside is named as this storage's),
        # names [(arg name, data_ptr, itemsize, dtype)]
        self.storages: list[dict] = []
        self._copies: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # original storage, padded bytes
        self._by_storage: dict[int, tuple[torch.Tensor, int, dict]] = {}

    def padded(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A view of ``t`` on a padded host copy of its storage (one copy per storage, so arguments
        that alias one another still do)."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._by_storage:
            nbytes = storage.nbytes()
            guard = -(-max(_GUARD_MIN_BYTES, nbytes) // _ALIGN) * _ALIGN
            buffer = torch.zeros(nbytes + 2 * guard, dtype=torch.uint8)
            original = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            buffer[guard:guard + nbytes].copy_(original)
            start = buffer.data_ptr() + guard
            entry = {"start": start, "end": start + nbytes, "near": guard, "names": []}
            self.storages.append(entry)
            self._copies.append((storage, buffer[guard:guard + nbytes]))
            self._by_storage[key] = (buffer, guard, entry)
        buffer, guard, entry = self._by_storage[key]
        view = torch.empty(0, dtype=t.dtype).set_(
            buffer.untyped_storage(), guard // t.element_size() + t.storage_offset(), t.size(), t.stride())
        entry["names"].append((name, view.data_ptr(), t.element_size(), t.dtype))
        return view

    def copy_back(self) -> None:
        for storage, data in self._copies:
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(data)

    def reach(self, name: str, t: torch.Tensor) -> None:
        """Count ``t``'s own storage as in bounds: a tensor the kernel reaches through an address it
        loads from a table (``declare_table``), not as an argument, so it runs on the tensor itself."""
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._by_storage:
            # No guard band here: an address this close past it is still taken for this tensor's.
            entry = {"start": storage.data_ptr(), "end": storage.data_ptr() + storage.nbytes(),
                     "near": _GUARD_MIN_BYTES, "names": []}
            self.storages.append(entry)
            self._by_storage[storage.data_ptr()] = (None, 0, entry)
        self._by_storage[storage.data_ptr()][2]["names"].append((name, t.data_ptr(), t.element_size(), t.dtype))

    def check(self, kind: str, ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int, program) -> None:
        ptrs = np.asarray(ptrs, dtype=np.uint64)
        active = ptrs[np.broadcast_to(np.asarray(mask, dtype=bool), ptrs.shape)] if mask is not None else ptrs.ravel()
        if active.size == 0:
            return
        # Storages never overlap: the one that could hold an address is the last starting at or before it.
        ordered = sorted(self.storages, key=lambda e: e["start"])
        starts = np.array([e["start"] for e in ordered], dtype=np.uint64)
        ends = np.array([e["end"] for e in ordered], dtype=np.uint64)
        at = np.searchsorted(starts, active, side="right") - 1
        inside = (at >= 0) & (active + np.uint64(itemsize) <= ends[np.maximum(at, 0)])
        if inside.all():
            return
        bad = int(active[~inside][0])
        raise OutOfBoundsAccess(self._describe(kind, bad, int((~inside).sum()), int(active.size), program))

    def _describe(self, kind: str, address: int, n_bad: int, n_active: int, program) -> str:
        where = f"out-of-bounds {kind} in kernel '{self.kernel}' (program {tuple(int(i) for i in program)})"
        if not self.storages:
            return f"{where}: the launch was given no tensor"
        def distance(e: dict) -> int:
            return 0 if e["start"] <= address < e["end"] else min(abs(address - e["start"]), abs(address - e["end"]))

        entry = min(self.storages, key=distance)
        name, base, itemsize, dtype = entry["names"][0]
        lanes = f"{n_bad} of {n_active} unmasked lanes out"
        # Past the guard bands the address belongs to no tensor, and which storage happens to lie
        # nearest is the allocator's doing: name none.
        if distance(entry) > entry["near"]:
            return (f"{where}: address {address:#x} is far outside every tensor of the launch (the nearest, "
                    f"'{name}', is {distance(entry)} bytes away); {lanes}: a wild offset?")
        offset = (address - base) // itemsize if address >= base else -((base - address) // itemsize)
        first = (entry["start"] - base) // itemsize if entry["start"] >= base else -((base - entry["start"]) // itemsize)
        last = (entry["end"] - base) // itemsize - 1
        shared = f" (shared with {', '.join(repr(n) for n, *_ in entry['names'][1:])})" if len(entry["names"]) > 1 else ""
        return (f"{where}: '{name}'{shared} at element {offset}, outside its elements {first}..{last} "
                f"({str(dtype).replace('torch.', '')}); {lanes}: is a mask missing?")


_state = {"installed": False, "launch": None, "off": 0}


def enabled() -> bool:
    return os.environ.get(CHECK_VAR, "1").strip().lower() not in {"0", "false", "off", "no"}


@contextlib.contextmanager
def unchecked():
    """Launches in this block run on the interpreter as it comes (for timing, where checks cost)."""
    _state["off"] += 1
    try:
        yield
    finally:
        _state["off"] -= 1


# Address tables (optim.multi_tensor_table): the storage of a table -> weak references to its views
# and to the tensors whose addresses it holds, by name. Weak, so a table never keeps a tensor alive;
# an entry whose views are all gone is stale (its address may be reused) and is dropped.
_tables: dict[int, tuple[list, list]] = {}


def declare_table(views, named) -> None:
    """``views`` (of one buffer) hold the addresses of the ``named`` (name, tensor) pairs: a launch
    given one of the views may touch those tensors, which it reaches by address, not as arguments."""
    if not (_state["installed"] and enabled()):
        return
    for key in [k for k, (refs, _) in _tables.items() if all(r() is None for r in refs)]:
        del _tables[key]
    _tables[views[0].untyped_storage().data_ptr()] = ([weakref.ref(v) for v in views],
                                                      [(name, weakref.ref(t)) for name, t in named])


def _reached(values) -> list[tuple[str, torch.Tensor]]:
    tables = {v.untyped_storage().data_ptr() for v in values if isinstance(v, torch.Tensor)} & _tables.keys()
    out = []
    for refs, named in (_tables[key] for key in tables):
        if any(r() is not None for r in refs):
            out += [(name, t) for name, ref in named if (t := ref()) is not None]
    return out


def _padded_args(launch: _Launch, names: list[str], args: tuple, kwargs: dict):
    def pad(name, value):
        if isinstance(value, torch.Tensor):
            return launch.padded(name, value)
        if isinstance(value, tuple):
            return type(value)(*(pad(f"{name}[{i}]", v) for i, v in enumerate(value))) \
                if hasattr(value, "_fields") else tuple(pad(f"{name}[{i}]", v) for i, v in enumerate(value))
        return value

    return ([pad(names[i] if i < len(names) else f"arg{i}", a) for i, a in enumerate(args)],
            {k: pad(k, v) for k, v in kwargs.items()})


def install(interp=None) -> None:
    """Wrap the interpreter's launch and memory operations (idempotent; imports Triton's interpreter
    unless given the module)."""
    if _state["installed"]:
        return
    if interp is None:
        import triton.runtime.interpreter as interp

    builder, executor = interp.InterpreterBuilder, interp.GridExecutor
    launch_plain, load_plain, store_plain = executor.__call__, builder.create_masked_load, builder.create_masked_store
    rmw_plain, cas_plain = builder.create_atomic_rmw, builder.create_atomic_cas

    def checked_launch(self, *args, **kwargs):
        if _state["off"] or _state["launch"] is not None or not enabled():
            return launch_plain(self, *args, **kwargs)
        launch = _Launch(getattr(self.fn, "__name__", "kernel"))
        reached = _reached([*args, *kwargs.values()])
        args, kwargs = _padded_args(launch, list(self.arg_names), args, kwargs)
        for name, tensor in reached:
            launch.reach(name, tensor)
        _state["launch"] = launch
        try:
            launch_plain(self, *args, **kwargs)
        except interp.InterpreterError as exc:
            cause = exc.__cause__
            if isinstance(cause, OutOfBoundsAccess):
                raise OutOfBoundsAccess(str(cause)) from None  # the interpreter's wrapper hides the type
            raise
        finally:
            _state["launch"] = None
        launch.copy_back()

    def check(self, kind, ptrs, mask, itemsize):
        launch = _state["launch"]
        if launch is not None:
            launch.check(kind, ptrs.data, None if mask is None else mask.data, itemsize, self.grid_idx or (0, 0, 0))

    def masked_load(self, ptrs, mask, other, *rest):
        check(self, "load", ptrs, mask, interp._get_np_dtype(ptrs.get_element_ty()).itemsize)
        return load_plain(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check(self, "store", ptrs, mask, value.data.dtype.itemsize)
        return store_plain(self, ptrs, value, mask, *rest)

    def atomic_rmw(self, op, ptr, val, mask, *rest):
        check(self, "atomic", ptr, mask, val.data.dtype.itemsize)
        return rmw_plain(self, op, ptr, val, mask, *rest)

    def atomic_cas(self, ptr, cmp, val, *rest):
        check(self, "atomic", ptr, None, val.data.dtype.itemsize)
        return cas_plain(self, ptr, cmp, val, *rest)

    executor.__call__ = checked_launch
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    _state["installed"] = True


class _InstallAfterImport:
    """A meta-path finder that installs the checks once Triton imports its interpreter, so that
    importing ``fastdl_lab`` never imports Triton itself."""

    def find_spec(self, name, path=None, target=None):
        if name != INTERPRETER_MODULE:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_plain = spec.loader.exec_module

        def exec_module(module):
            exec_plain(module)
            install(module)

        spec.loader.exec_module = exec_module
        return spec


def install_when_interpreting() -> None:
    """Install the checks now if Triton's interpreter is loaded, else as soon as it is."""
    if not enabled() or _state["installed"]:
        return
    if INTERPRETER_MODULE in sys.modules:
        install()
    elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())
