"""A kernel that shows whether Triton's interpreter can run the course's kernels on this host.

Its loop runs up to a bound passed as an argument, as the GEMM's, softmax's and LayerNorm's loops
do. The interpreter hands such a bound to ``range`` as a one-element array; Triton 3.6 converts it
with ``int()``, which NumPy 2.4 refuses for arrays that are not 0-dimensional, so there every such
kernel fails (triton-lang/triton#9171, fixed in Triton 3.7). Imported only when asked
(``device.interpreter_problem``): importing it imports Triton.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def _count_up(out, n):
    for i in range(0, n):
        tl.store(out + i, i)


def run(n: int = 3) -> list[int]:
    """What the interpreter writes for ``_count_up``: ``[0, 1, ..., n - 1]`` where it works."""
    out = torch.full((n,), -1, dtype=torch.int32)
    InterpretedFunction(_count_up)[(1,)](out, n)
    return out.tolist()
