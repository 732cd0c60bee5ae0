"""Lab 01's first kernel: the scaled add on ragged and exact lengths, the ownership picture's
arithmetic, the 2-D pointer block, and what a missing mask does under the checked interpreter."""

import numpy as np
import pytest
import torch

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import checks, scaled_add

DEV = "cuda" if device.has_gpu() else "cpu"


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, block", [(1, 16), (1000, 256), (1024, 256), (77, 1), (5000, None)])
def test_scaled_add_matches_reference(n, block, dtype):
    x = checks.randn(n, dtype=dtype, seed=n, device=DEV)
    y = checks.randn(n, dtype=dtype, seed=n + 1, device=DEV)
    out = scaled_add.scaled_add(x, y, -1.5, block=block)
    assert out.shape == x.shape and out.dtype == dtype
    checks.assert_close(out, scaled_add.scaled_add_ref(x, y, -1.5))


@pytest.mark.interpret
def test_shapes_are_kept_and_empty_tensors_launch_nothing():
    x = checks.randn(3, 7, seed=1, device=DEV)
    y = checks.randn(3, 7, seed=2, device=DEV)
    checks.assert_close(scaled_add.scaled_add(x, y, 2.0, block=8), 2 * x + y)
    assert scaled_add.scaled_add(x[:0], y[:0]).shape == (0, 7)


def test_the_launcher_refuses_what_the_kernel_cannot_address():
    x = torch.zeros(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        scaled_add.scaled_add(x.t(), x.t())
    with pytest.raises(ValueError, match="differ"):
        scaled_add.scaled_add(x, torch.zeros(24))
    with pytest.raises(ValueError, match="power of two"):
        scaled_add.scaled_add(x, x, block=100)


@pytest.mark.parametrize("n, block", [(20, 8), (16, 8), (1, 64), (1000, 256)])
def test_ownership_covers_every_element_once_and_masks_only_the_tail(n, block):
    own = scaled_add.ownership(n, block)
    assert own.programs == triton.cdiv(n, block)
    assert sorted(own.offsets[own.kept].tolist()) == list(range(n))
    assert own.dropped == own.programs * block - n
    assert own.kept[:-1].all()  # only the last program has anything masked


def test_pointer_block_is_what_a_strided_view_reads():
    memory = torch.arange(48)
    x = memory.view(6, 8)
    for view, corner in ((x, (1, 2)), (x.t(), (2, 1)), (x[::2, 1::3], (0, 1))):
        (r, c), (sm, sn) = corner, view.stride()
        offsets = scaled_add.pointer_block(r, c, 3, 2, sm, sn) + view.storage_offset()
        assert np.array_equal(offsets, view[r:r + 3, c:c + 2].numpy())


@triton.jit
def _no_mask(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, alpha * tl.load(x_ptr + offs) + tl.load(y_ptr + offs))


@pytest.mark.interpret
def test_a_missing_mask_is_stopped_by_the_checked_interpreter():
    from fastdl_lab import bounds
    from fastdl_lab.bounds import OutOfBoundsAccess

    if not (device.interpreting() and bounds.enabled()):
        pytest.skip("unchecked (a GPU, or FASTDL_CHECK_BOUNDS=0): nothing stops the overrun, which is the lesson")

    x, y = checks.randn(1000, seed=3), checks.randn(1000, seed=4)
    with pytest.raises(OutOfBoundsAccess):
        scaled_add.scaled_add(x, y, 0.5, kernel=_no_mask, block=256)
    # A length the block divides needs no mask: the same kernel is then correct.
    checks.assert_close(scaled_add.scaled_add(x[:768].contiguous(), y[:768].contiguous(), 0.5, kernel=_no_mask,
                                              block=256), scaled_add.scaled_add_ref(x[:768], y[:768], 0.5))
