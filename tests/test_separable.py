"""Depthwise-separable convolution: the FLOP formulas against PyTorch's own count, and the blocks."""

import pytest
import torch

from fastdl_lab import separable


@pytest.mark.parametrize("c_in, c_out, size, k", [(3, 8, 7, 3), (16, 24, 10, 5), (8, 8, 4, 1)])
def test_the_formulas_equal_what_flopcountermode_counts(c_in, c_out, size, k):
    x = torch.randn(1, c_in, size, size)
    assert separable.counted_flops(separable.standard_block(c_in, c_out, k), x) == separable.conv_flops(
        c_in, c_out, size, size, k)
    assert separable.counted_flops(separable.separable_block(c_in, c_out, k), x) == separable.separable_flops(
        c_in, c_out, size, size, k)


def test_the_ratio_is_the_papers_and_a_grouped_count_divides_by_the_groups():
    assert separable.separable_flops(32, 64, 14, 14, 3) / separable.conv_flops(32, 64, 14, 14, 3) == pytest.approx(
        1 / 64 + 1 / 9)
    assert separable.conv_flops(12, 12, 5, 5, 3, groups=12) * 12 == separable.conv_flops(12, 12, 5, 5, 3)
    with pytest.raises(ValueError, match="groups=5"):
        separable.conv_flops(12, 12, 5, 5, 3, groups=5)


def test_both_blocks_keep_the_image_and_are_seeded():
    x = torch.randn(2, 6, 9, 9)
    std, sep = separable.standard_block(6, 10, 3, seed=2), separable.separable_block(6, 10, 3, seed=2)
    assert std(x).shape == sep(x).shape == (2, 10, 9, 9)
    assert sep[0].groups == 6 and sep[1].kernel_size == (1, 1)
    assert torch.equal(separable.separable_block(6, 10, 3, seed=2)(x), sep(x))


def test_the_batch1_comparison_reports_counted_flops_and_a_timing():
    r = separable.batch1_comparison(8, 16, 12, reps=3)
    assert r["flop_ratio"] == pytest.approx(separable.flop_ratio(16, 3))
    assert r["flops"]["standard"] == separable.conv_flops(8, 16, 12, 12, 3)
    assert 0 < r["depthwise_share"]["flops"] < 1 and 0 < r["depthwise_share"]["time"] < 1
    assert r["time_ratio"] == pytest.approx(r["timing"].candidate.median / r["timing"].baseline.median)
