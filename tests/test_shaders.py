"""Matrix multiply as render passes: the emulation computes A @ B and counts what a fragment fetches."""

import pytest
import torch

from fastdl_lab import shaders


def test_single_and_multi_pass_compute_the_product():
    a, b = torch.randn(7, 40), torch.randn(40, 5)
    c, render = shaders.render_single_pass(a, b)
    torch.testing.assert_close(c, a @ b, atol=1e-5, rtol=1e-5)
    assert render == shaders.Render(passes=1, fetches_per_output=80)
    for k_per_pass, passes in ((16, 3), (40, 1), (1, 40), (64, 1)):
        c, render = shaders.render_multi_pass(a, b, k_per_pass)
        torch.testing.assert_close(c, a @ b, atol=1e-5, rtol=1e-5)
        # Each pass after the first reads the other target once more per fragment.
        assert render == shaders.Render(passes=passes, fetches_per_output=80 + passes - 1)


def test_a_shader_longer_than_allowed_is_refused_and_shapes_are_checked():
    a, b = torch.randn(2, shaders.MAX_SHADER_K + 1), torch.randn(shaders.MAX_SHADER_K + 1, 2)
    with pytest.raises(ValueError, match="in passes"):
        shaders.render_single_pass(a, b)
    with pytest.raises(ValueError, match=r"\(M, K\) and \(K, N\)"):
        shaders.render_multi_pass(a, b.T, 8)
    with pytest.raises(ValueError, match="at least 1"):
        shaders.render_multi_pass(a, b, 0)


def test_a_tiled_kernel_loads_a_fraction_of_what_fragments_fetch():
    assert shaders.tiled_loads_per_output(4096, 64, 64) == 128
    assert shaders.tiled_loads_per_output(4096, 128, 64) == pytest.approx(4096 * 3 / 128)
    # Against a fragment's 2K texels: 64 times fewer for 64 x 64 tiles.
    assert 2 * 4096 / shaders.tiled_loads_per_output(4096, 64, 64) == 64
