"""What a rank holds and what it sends, measured by the course's own code (lab 07's FSDP and
tensor-parallel items).

A student's sharding class reports nothing the grade rests on. Inside the rank, the trusted loop
(``fsdp.train_fsdp``, ``tensor_parallel.tp_mlp_trial``) takes its figures here:

* ``snapshot`` / ``resident_bytes``: every tensor storage alive in the process, found through the
  garbage collector, before and after training. A storage that is new, or that existed before but
  changed size or content, counts: so a notebook's earlier tensors do not, while a buffer set
  aside in advance and filled during training does. Between the two the collector's objects are
  frozen, so that collecting garbage before the second walk is quick;
* ``sharded_collectives``: while it lasts, all-gathers and reduce-scatters are counted at the
  process group (under every ``torch.distributed`` function that reaches them), the storage each
  all-gather fills is followed with a weak reference, so that the bytes still allocated in earlier
  gathers are known at each new one; every other collective raises;
* ``allreduce_only``: the same for tensor parallelism, where only all-reduces may move data.

These run in the student's process: the item that uses them binds them before the student's
cells run and verifies them afterwards (``Item.instruments``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib

import torch
from torch._C import _distributed_c10d as c10d
from torch.multiprocessing.reductions import StorageWeakRef

# ProcessGroup methods that move tensor data (torch 2.13); the ones a mode allows are counted,
# the rest refused. barrier and the group's bookkeeping stay free.
DATA_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
                "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter",
                "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
                "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter", "alltoall",
                "alltoall_base", "all_to_all_single", "send", "recv", "recv_anysource")
POINT_TO_POINT = ("send", "recv", "recv_anysource")
GATHERS = ("all_gather_single", "_allgather_base", "allgather")
REDUCE_SCATTERS = ("reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter")


class CollectiveRefused(RuntimeError):
    """A collective that the technique being graded does not use."""


# --- storages alive in the process --------------------------------------------------------------

def _storage(obj) -> torch.UntypedStorage | None:
    # The base classes' own methods, with subclasses' __torch_function__ off: a tensor subclass
    # must not be able to report a storage of its choosing.
    kind = type(obj)
    try:
        with torch._C.DisableTorchFunctionSubclass():
            if issubclass(kind, torch.Tensor):
                return torch.Tensor.untyped_storage(obj)
            if issubclass(kind, torch.TypedStorage):
                return torch.TypedStorage.untyped(obj)
            if issubclass(kind, torch.UntypedStorage):
                return obj
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # tensors without storage (sparse, meta, fake): nothing to count
    return None


def _nbytes(storage: torch.UntypedStorage) -> int:
    return torch.UntypedStorage.nbytes(storage)


# The storage's device as the C type reports it: a subclass cannot redefine what this reads.
_DEVICE = torch.UntypedStorage.device


def _holds_bytes(storage: torch.UntypedStorage) -> bool:
    # A meta storage has a size but no bytes (a model built on the meta device, torch's own
    # bookkeeping): nothing to count, nothing to read.
    return _nbytes(storage) > 0 and _DEVICE.__get__(storage).type != "meta"


def _tensor_bytes(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.numel(t) * torch.Tensor.element_size(t)


def _subclasses(root: type) -> set[type]:
    found, todo = set(), [root]
    while todo:
        kind = todo.pop()
        if kind not in found:
            found.add(kind)
            todo.extend(type.__subclasses__(kind))
    return found


def _storages_of(objects) -> dict[int, torch.UntypedStorage]:
    """The storages with bytes under the tensors and storage objects among ``objects``."""
    # Matched on the exact type, from every subclass defined so far: a few hundred thousand
    # objects are checked in a set lookup each, and isinstance could run a __class__ property.
    kinds = _subclasses(torch.Tensor) | _subclasses(torch.UntypedStorage) | _subclasses(torch.TypedStorage)
    found = {}
    for obj in [o for o in objects if type(o) in kinds]:
        storage = _storage(obj)
        if storage is not None and _holds_bytes(storage):
            found[storage._cdata] = storage
    return found


def _digest(storage: torch.UntypedStorage) -> bytes:
    raw = torch.empty(0, dtype=torch.uint8).set_(storage.cpu(), 0, (_nbytes(storage),))
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).digest()


class Snapshot:
    """What lived in the process before training: the size and digest of every storage, and a
    weak reference to it. Then the collector's objects are frozen, so that collecting garbage
    after training walks only the objects created since, not the few hundred thousand a
    notebook holds. A context manager: leaving it thaws them."""

    def __init__(self):
        self.storages = {key: (StorageWeakRef(s), _nbytes(s), _digest(s))
                         for key, s in _storages_of(gc.get_objects()).items()}
        gc.freeze()

    def storages_now(self) -> dict[int, torch.UntypedStorage]:
        """Every storage with bytes alive now that a tracked object refers to, or that existed at
        the snapshot. Garbage is collected while the old objects are frozen, then they are
        thawed and every object is walked: whatever anyone froze since is seen too."""
        gc.collect()
        gc.unfreeze()
        found = _storages_of(gc.get_objects())
        for key, (ref, _, _) in self.storages.items():
            if not ref.expired():
                found.setdefault(key, torch.UntypedStorage._new_with_weak_ptr(ref.cdata))
        return found

    def changed(self, key: int, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is new, or has another size or content than at the snapshot."""
        old = self.storages.get(key)
        return old is None or old[1] != _nbytes(storage) or old[2] != _digest(storage)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        gc.unfreeze()


def snapshot() -> Snapshot:
    """Take the ``Snapshot`` that ``resident_bytes`` will compare with: ``with snapshot() as before:``."""
    return Snapshot()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    storages = {}
    for t in tensors:
        storage = _storage(t)
        if storage is not None:
            storages[storage._cdata] = _nbytes(storage)
    return sum(storages.values())


def shares_storage(t, base) -> bool:
    """Whether ``t`` lives in ``base``'s storage: a view of it (an empty one included), not a copy."""
    mine, theirs = _storage(t), _storage(base)
    return mine is not None and theirs is not None and mine._cdata == theirs._cdata


def resident_bytes(before: Snapshot, exclude=(), also=()) -> int:
    """Bytes of the storages alive now that are new or changed since ``before``, leaving out
    those under the tensors in ``exclude``; ``also`` adds storages the collector cannot see (held
    by autograd's C++ side, say)."""
    storages = before.storages_now()
    for storage in also:
        if _nbytes(storage) > 0:
            storages[storage._cdata] = storage
    for t in exclude:
        storage = _storage(t)
        if storage is not None:
            storages.pop(storage._cdata, None)
    return sum(_nbytes(s) for key, s in storages.items() if before.changed(key, s))


# --- collectives, counted at the process group --------------------------------------------------

@contextlib.contextmanager
def _process_group_mode(counted: dict, refusal: str):
    """Replace every data-moving ProcessGroup method: ``counted`` maps a name to a wrapper
    factory taking the original; any other raises ``CollectiveRefused(refusal)``."""
    patches = []

    def refuse(name):
        def refused(*args, **kwargs):
            raise CollectiveRefused(f"{name}: {refusal}")
        return refused

    try:
        for name in DATA_METHODS:
            if hasattr(c10d.ProcessGroup, name):
                original = getattr(c10d.ProcessGroup, name)
                patches.append((c10d.ProcessGroup, name, original))
                setattr(c10d.ProcessGroup, name, counted[name](original) if name in counted else refuse(name))
        patches += refuse_backends()
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def refuse_backends() -> list[tuple[type, str, object]]:
    """Make every data-moving method of a process group's backend (``pg._get_backend(device)``)
    raise when called from Python: torch.distributed reaches its backends from C++, so only a
    route around the process group's own methods ends here. Returns what to put back."""
    patches = []

    def refused(name):
        def refuse(*args, **kwargs):
            raise CollectiveRefused(f"a backend's own {name}: data moves through the process group, where it is counted")
        return refuse

    for name in DATA_METHODS:
        if hasattr(c10d.Backend, name):
            patches.append((c10d.Backend, name, getattr(c10d.Backend, name)))
            setattr(c10d.Backend, name, refused(name))
    return patches


def _tensors(nested) -> list[torch.Tensor]:
    if isinstance(nested, torch.Tensor):
        return [nested]
    return [t for item in nested for t in _tensors(item)]


class WireLog:
    """What ``sharded_collectives`` saw."""

    def __init__(self):
        self.all_gathers = self.reduce_scatters = 0
        self.gathered_bytes = self.reduced_bytes = 0
        self.max_live_buffers = self.max_live_bytes = 0
        self._gathered: dict[int, StorageWeakRef] = {}

    def gathered_storages(self) -> list[torch.UntypedStorage]:
        """The storages earlier all-gathers filled that still exist (with or without bytes)."""
        return [torch.UntypedStorage._new_with_weak_ptr(ref.cdata) for ref in self._gathered.values()
                if not ref.expired()]

    def before_gather(self, outputs: list[torch.Tensor]) -> None:
        """Log a gather into ``outputs``, and how many earlier gathers' buffers still hold bytes."""
        filling = {_storage(t)._cdata for t in outputs}
        live = [_nbytes(s) for s in self.gathered_storages() if _nbytes(s) > 0 and s._cdata not in filling]
        self.max_live_buffers = max(self.max_live_buffers, len(live))
        self.max_live_bytes = max(self.max_live_bytes, sum(live))
        self.all_gathers += 1
        for t in outputs:
            self.gathered_bytes += _tensor_bytes(t)
            storage = _storage(t)
            self._gathered.setdefault(storage._cdata, StorageWeakRef(storage))

    def summary(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("all_gathers", "reduce_scatters", "gathered_bytes", "reduced_bytes",
                                              "max_live_buffers", "max_live_bytes")}


@contextlib.contextmanager
def sharded_collectives():
    """While it lasts, only all-gathers and reduce-scatters move data, and each is logged.

    Yields a ``WireLog``. Output tensors are the second argument of the single-tensor methods
    (``all_gather_single(output, input, opts)``) and the first of the list ones.
    """
    log = WireLog()

    def gather(original):
        def counted(pg, output, *args, **kwargs):
            log.before_gather(_tensors(output))
            return original(pg, output, *args, **kwargs)
        return counted

    def reduce_scatter(original):
        def counted(pg, output, inputs, *args, **kwargs):
            log.reduce_scatters += 1
            log.reduced_bytes += sum(_tensor_bytes(t) for t in _tensors(inputs))
            return original(pg, output, inputs, *args, **kwargs)
        return counted

    counted = {name: gather for name in GATHERS} | {name: reduce_scatter for name in REDUCE_SCATTERS}
    with _process_group_mode(counted, "fully sharded training moves weights with all-gathers and gradients "
                                      "with reduce-scatters, nothing else"):
        yield log


@contextlib.contextmanager
def allreduce_only():
    """While it lasts, only all-reduces move data; yields a one-element list counting them."""
    calls = [0]

    def allreduce(original):
        def counted(pg, *args, **kwargs):
            calls[0] += 1
            return original(pg, *args, **kwargs)
        return counted

    with _process_group_mode({"allreduce": allreduce}, "a tensor-parallel MLP needs all-reduces only"):
        yield calls
