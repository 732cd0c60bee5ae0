"""Scaled add, the first kernel of lab 01 gemm: one dimension, one program per block, one mask.

``out = alpha * x + y`` over flat tensors is the smallest kernel with every part a Triton kernel
has: a grid of programs, a program id, a block of offsets, a mask for the ragged end, loads, a
store. Nothing is reused and nothing is reduced, so the kernel is only about who owns what.

- ``scaled_add_ref``: the result in float64, rounded to the input's dtype;
- ``scaled_add`` with ``_scaled_add_kernel``: ``cdiv(n, BLOCK)`` programs, each owning ``BLOCK``
  consecutive elements, run by the interpreter on a CPU;
- ``ownership``: the offsets every program computes and which of them its mask keeps, the picture
  the lab draws;
- ``pointer_block``: the element offsets of a 2-D block of pointers built from two strides, the
  arithmetic every 2-D kernel of the course (row sums, matmul) starts from.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
import triton.language as tl


def scaled_add_ref(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * x + y`` computed in float64 and returned in ``x``'s dtype."""
    return (alpha * x.double() + y.double()).to(x.dtype)


@triton.jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):
    """Program ``pid`` writes elements ``pid * BLOCK`` to ``pid * BLOCK + BLOCK - 1`` of out."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # Only the last program can run past n; for every other one the mask is all true.
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside)
    y = tl.load(y_ptr + offs, mask=inside)
    # fp32 arithmetic whatever the storage type, rounded once on the way out.
    out = alpha * x.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=inside)


def default_block(capability: int | None) -> int:
    """Elements per program: wide under the interpreter (it pays per program, not per element);
    on a GPU 1024, eight fp32 values for each of 4 warps' 128 threads."""
    return 4096 if capability is None else 1024


def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0, *, kernel=None, block: int | None = None,
               num_warps: int = 4) -> torch.Tensor:
    """``alpha * x + y`` with a Triton kernel (``kernel`` defaults to ``_scaled_add_kernel`` and must
    take its arguments). ``x`` and ``y`` are contiguous tensors of one shape and dtype."""
    for name, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        # The kernel walks flat offsets: a strided view would need its strides, which this kernel lacks.
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel addresses it by flat offset)")
        device.check_kernel_tensor(t, f"{name} is")
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(f"x and y differ: {tuple(x.shape)} {x.dtype} {x.device} vs "
                         f"{tuple(y.shape)} {y.dtype} {y.device}")
    block = default_block(device.capability(x)) if block is None else block
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two (tl.arange's rule), got {block!r}")
    out = checks.output_buffer(tuple(x.shape), x.dtype, x)
    n = x.numel()
    if n:
        (kernel or _scaled_add_kernel)[(triton.cdiv(n, block),)](x, y, out, float(alpha), n, BLOCK=block,
                                                                  num_warps=num_warps)
    return out


@dataclasses.dataclass(frozen=True)
class Ownership:
    """What the programs of a 1-D launch over ``n`` elements in blocks of ``block`` compute."""

    n: int
    block: int
    offsets: np.ndarray  # programs x block: program p's offsets, p * block + arange(block)
    kept: np.ndarray  # same shape: offsets < n, the mask

    @property
    def programs(self) -> int:
        return self.offsets.shape[0]

    @property
    def dropped(self) -> int:
        """Offsets computed past the end, all in the last program, which the mask switches off."""
        return int((~self.kept).sum())


def ownership(n: int, block: int) -> Ownership:
    """The offsets each of the ``cdiv(n, block)`` programs computes, and its mask, in NumPy: the same
    arithmetic as the kernel, without running it."""
    if n < 1 or block < 1:
        raise ValueError(f"n and block must be positive, got n={n}, block={block}")
    programs = -(-n // block)
    offsets = np.arange(programs)[:, None] * block + np.arange(block)[None, :]
    return Ownership(n, block, offsets, offsets < n)


def pointer_block(row0: int, col0: int, block_m: int, block_n: int, stride_m: int, stride_n: int) -> np.ndarray:
    """Element offsets of the ``block_m x block_n`` block whose corner is ``(row0, col0)``: what
    ``(row0 + arange(BM))[:, None] * stride_m + (col0 + arange(BN))[None, :] * stride_n`` broadcasts to."""
    rows = row0 + np.arange(block_m)
    cols = col0 + np.arange(block_n)
    return rows[:, None] * stride_m + cols[None, :] * stride_n


def check() -> None:
    """The kernel on ragged and exact lengths in fp32 and fp16; raises on the first mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for n, block in [(1, 16), (1000, 256), (1024, 256), (4097, None)]:
            x = checks.randn(n, dtype=dtype, seed=n, device=dev)
            y = checks.randn(n, dtype=dtype, seed=n + 1, device=dev)
            checks.assert_close(scaled_add(x, y, 0.5, block=block), scaled_add_ref(x, y, 0.5),
                                name=f"scaled_add {dtype} n={n}")
    print("scaled_add: checks passed")


if __name__ == "__main__":
    check()
