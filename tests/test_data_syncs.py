import numpy as np
import pytest
import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils.data import DataLoader

from fastdl_lab.data.syncs import SyncCounter

T = torch.arange(6.0)
MASK = T > 2

# (what it does, syncs, uploads) on the CPU stand-in, where every tensor is a device tensor.
CASES = {
    "item": (lambda: T[1].item(), 1, 0),
    "float": (lambda: float(T[1]), 1, 0),
    "int": (lambda: int(T[1]), 1, 0),
    "bool": (lambda: bool(T[1]), 1, 0),
    "if": (lambda: 1 if T.sum() else 0, 1, 0),
    "tolist": (lambda: T.tolist(), 1, 0),
    "numpy": (lambda: T.numpy(), 1, 0),
    "np.asarray": (lambda: np.asarray(T), 1, 0),
    "print": (lambda: str(T), 1, 0),
    "nonzero": (lambda: T.nonzero(), 1, 0),
    "masked_select": (lambda: T.masked_select(MASK), 1, 0),
    "mask index": (lambda: T[MASK], 1, 0),
    "unique": (lambda: T.unique(), 1, 0),
    "repeat_interleave": (lambda: T.repeat_interleave(T.long()), 1, 0),
    "repeat_interleave sized": (lambda: T.repeat_interleave(T.long(), output_size=15), 0, 0),
    "tensor(list)": (lambda: torch.tensor([1.0, 2.0]), 0, 1),
    "from_numpy": (lambda: torch.from_numpy(np.arange(3)), 0, 1),
    "as_tensor(ndarray)": (lambda: torch.as_tensor(np.ones(2)), 0, 1),
    "item of an upload": (lambda: torch.tensor(3.0).item(), 1, 1),
}


def _stacks():
    return len(_get_current_function_mode_stack()), len(_get_current_dispatch_mode_stack())


@pytest.mark.parametrize("name", CASES)
def test_each_kind_is_counted_exactly(name):
    fn, syncs, uploads = CASES[name]
    with SyncCounter("cpu") as c:
        fn()
    assert (c.syncs, c.uploads) == (syncs, uploads), c.report()


def test_a_sync_free_step_counts_ops_only():
    with SyncCounter("cpu") as c:
        (T * 2 + 1).sum()
    assert (c.syncs, c.uploads, c.ops) == (0, 0, 3)
    assert c.events["ops", "aten.mul.Tensor"] == 1


def test_counting_changes_no_numbers():
    torch.manual_seed(0)
    net, x = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)), torch.randn(9, 7)

    def grads():
        net.zero_grad()
        net(x).logsumexp(1).mean().backward()
        return [p.grad.clone() for p in net.parameters()]

    plain = grads()
    with SyncCounter("cpu") as c:
        counted = grads()
    assert c.ops > 0
    assert all(torch.equal(a, b) for a, b in zip(plain, counted))


def test_exceptions_leave_the_mode_stacks_as_they_were():
    before = _stacks()
    c = SyncCounter("cpu")
    with pytest.raises(ZeroDivisionError):
        with c:
            T[0].item()
            1 / 0
    assert _stacks() == before
    assert c.syncs == 1 and c.intact
    with c:  # usable again, and counts on
        T.tolist()
    assert c.syncs == 2


def test_nesting():
    with SyncCounter("cpu") as outer:
        T[0].item()
        with SyncCounter("cpu") as inner:
            T.tolist()
            torch.tensor([1])
        with pytest.raises(RuntimeError, match="already active"):
            with outer:
                pass
    assert (inner.syncs, inner.uploads) == (1, 1)
    assert (outer.syncs, outer.uploads) == (2, 1)


def test_a_mode_left_behind_is_removed_and_reported():
    class Stray(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    before = _stacks()
    with SyncCounter("cpu") as c:
        Stray().__enter__()
    assert _stacks() == before and not c.intact


def test_the_loaders_own_bookkeeping_is_host_work():
    # RandomSampler reads its shuffled indices and the iterator its worker seed: host values on a
    # GPU too, so the CPU stand-in files them under "host".
    loader = DataLoader(list(range(10)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    with SyncCounter("cpu") as c:
        batches = [b for b in loader]
    assert len(batches) == 3
    assert (c.syncs, c.uploads) == (0, 0)
    assert c.events["host", "Tensor.tolist"] >= 1 and c.events["host", "aten.lift_fresh.default"] == 3


def test_another_device_separates_host_work_from_device_work():
    # The meta device stands in for a GPU: values on the CPU are host values there.
    x = torch.randn(4)
    with SyncCounter("meta") as c:
        m = x.to("meta", non_blocking=True)
        (m * 2).sum()
        torch.empty(4, device="meta").copy_(x)
        x.sum().item()
        x.tolist()
        torch.tensor([1, 2])
    assert (c.syncs, c.uploads, c.ops) == (0, 2, 5)
    assert c.events["uploads", "h2d aten._to_copy.default (non_blocking)"] == 1
    assert c.events["uploads", "h2d aten.copy_.default"] == 1
    assert c.events["host", "Tensor.tolist"] == 1 and c.events["host", "aten._local_scalar_dense.default"] == 1


def test_report_names_counts_and_causes():
    with SyncCounter("cpu") as c:
        for _ in range(4):
            T.sum().item()
    text = c.report(steps=4)
    assert "syncs 4 (1.0/step)" in text and "aten._local_scalar_dense.default x4" in text
