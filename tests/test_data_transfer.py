"""Lab 06's host-to-device section: the batch and link arithmetic, and the copy timings that need
a GPU (run by the gpu test where there is one)."""

import pytest
import torch

from fastdl_lab import device
from fastdl_lab.data import transfer


def test_batch_bytes_and_link_time():
    assert transfer.batch_bytes((256, 3, 224, 224), torch.float32) == 256 * 3 * 224 * 224 * 4
    assert transfer.batch_bytes((256, 3, 224, 224), torch.uint8) * 4 == transfer.batch_bytes((256, 3, 224, 224),
                                                                                                torch.float32)
    assert transfer.link_seconds_ref(63_000_000_000, transfer.LINKS_GBS["PCIe 5.0 x16"]) == pytest.approx(1.0)
    # Each PCIe generation doubles the lane rate.
    gbs = [transfer.LINKS_GBS[f"PCIe {g}.0 x16"] for g in (3, 4, 5)]
    assert gbs[1] == pytest.approx(2 * gbs[0]) and gbs[2] == pytest.approx(2 * gbs[1])
    with pytest.raises(ValueError):
        transfer.link_seconds_ref(1, 0)


def test_copies_need_a_gpu():
    if device.has_gpu():
        pytest.skip("a GPU is here: the gpu test times the copies")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        transfer.copy_vs_matmul()


@pytest.mark.gpu
def test_copies_and_matmul_are_timed_on_a_gpu():
    moved = transfer.copy_vs_matmul(nbytes=8 << 20, matmul_n=512, reps=3)
    assert len(moved["timings"]) == 3 and all(t.median > 0 for t in moved["timings"].values())
    assert moved["rates"]["pinned copy (non_blocking)"].endswith("GB/s")
