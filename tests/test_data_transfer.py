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


def test_the_latency_ladder_measures_each_rung_here_and_names_the_gpu_ones():
    ladder = transfer.latency_ladder(reps=3)
    seconds = {r["what"]: r["seconds"] for r in ladder}
    assert len(ladder) == 7 and all(r["why"] for r in ladder)
    # A torch op's fixed cost is far above a Python call's, and 64 MiB far above 4 KiB.
    assert 0 < 10 * seconds["a Python function call"] < seconds["one torch op on a 1-element CPU tensor"]
    assert 100 * seconds["copy 4 KiB in host memory"] < seconds["copy 64 MiB in host memory"]
    gpu = [r for r in ladder if "GPU" in r["what"] or "device" in r["what"] or ".item()" in r["what"]]
    assert len(gpu) == 3
    if not device.has_gpu():
        assert all(r["seconds"] is None and r["why"] == "needs a GPU" for r in gpu)
    else:
        assert all(r["seconds"] > 0 for r in gpu)
