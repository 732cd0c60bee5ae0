"""Lab 01's execution-model arithmetic: sectors per warp load, occupancy limits, waves."""

import pytest

from fastdl_lab import simt


@pytest.mark.parametrize("stride, elem_bytes, sectors", [
    (1, 4, 4), (2, 4, 8), (4, 4, 16), (8, 4, 32), (1000, 4, 32), (1, 2, 2), (16, 2, 32), (0, 4, 1), (1, 8, 8),
])
def test_warp_sectors(stride, elem_bytes, sectors):
    assert simt.warp_sectors(stride, elem_bytes) == sectors


def test_an_element_straddling_sectors_counts_both():
    # 3-byte elements: lane 10 spans bytes 30..32, across the first sector boundary.
    assert simt.warp_sectors(1, 3, lanes=11) == 2
    assert simt.load_efficiency(1) == 1.0 and simt.load_efficiency(32) == pytest.approx(1 / 8)


def test_occupancy_names_the_binding_resource():
    # 200 registers x 128 threads: 25 600 (a multiple of 256 per warp) -> 2 programs in 65 536.
    regs = simt.occupancy(200, 49_152, 4, "h100")
    assert regs.programs_per_sm == 2 and regs.limited_by == "registers"
    # 64 KiB of shared memory (+1 KiB reserved) per program: 3 fit in an H100's 228 KiB, 2 in an A100's 164.
    assert simt.occupancy(32, 64 << 10, 4, "h100").limits["shared memory"] == 3
    assert simt.occupancy(32, 64 << 10, 4, "a100").programs_per_sm == 2
    # A T4 holds 32 warps: 8-warp programs, 4 at most; and 64 KiB does not fit beside anything.
    assert simt.occupancy(32, 0, 8, "t4").limited_by == "warp slots"
    assert simt.occupancy(32, 65 << 10, 4, "t4").programs_per_sm == 0
    # Tiny programs stop at the block slots.
    assert simt.occupancy(16, 0, 1, "h100").programs_per_sm == 32


def test_register_allocation_rounds_per_warp():
    # 129 registers round up to 136 per thread (4352 per warp, 256-aligned): 15 warps, 3 programs of 4.
    assert simt.occupancy(129, 0, 4, "h100").limits["registers"] == 3
    assert simt.occupancy(128, 0, 4, "h100").limits["registers"] == 4


def test_waves_and_errors():
    assert simt.waves(264, 2, "h100") == pytest.approx(1.0)
    assert simt.waves(1024, 2, "h100") == pytest.approx(1024 / 264)
    with pytest.raises(ValueError, match="does not fit"):
        simt.waves(10, 0)
    with pytest.raises(ValueError, match="unknown GPU"):
        simt.occupancy(32, 0, 4, "v100")
    with pytest.raises(ValueError):
        simt.warp_sectors(-1)
