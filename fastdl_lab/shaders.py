"""Matrix multiply on a GPU before CUDA: render passes and fragment shaders, emulated (lab 01).

Before CUDA (2007) a GPU ran only graphics pipelines, and general computation was dressed as
drawing (Larsen & McAllister, 2001; Krüger & Westermann, 2003). The matrices are **textures**; the
output C is the **render target**, one pixel per element; drawing one rectangle over the target
runs a **fragment shader** once per pixel, and the shader for pixel (i, j) fetches row i of A and
column j of B from the textures and writes their dot product. Two limits of the hardware of the
day shaped the algorithms:

- a shader had a bounded length (no loops early on; hundreds to a few thousand instructions
  later), so a long inner dimension K could not be one shader: it was split over several
  **passes**, each adding a K-chunk's partial products to what the previous pass wrote;
- a shader could not read the target it was writing, so passes **ping-pong** between two
  targets: pass p reads target p % 2 and writes the other.

Nothing is shared between fragments: every pixel fetches its own 2K texels, and only the texture
cache softens that. Fatahalian, Sugerman & Hanrahan (2004) measured such multiplies bound by
that fetch bandwidth, well short of the arithmetic the GPUs had. CUDA's shared memory is the
change that a tiled kernel (this lab's) is built on: a block of threads loads a tile once and
every thread of the block reuses it.

- ``fragment_shader``: what one pixel computes, vectorised over every pixel of the target;
- ``render_single_pass`` / ``render_multi_pass``: one pass over all of K (refused past a shader
  length), or passes of ``k_per_pass`` with ping-pong targets; each returns C and a ``Render``
  count of passes and texel fetches per output;
- ``tiled_loads_per_output``: the global loads per output of a ``block_m x block_n`` tiled kernel.
"""

from __future__ import annotations

import dataclasses
import math

import torch

# Instructions a shader could run in the Shader Model 2.0 era: a budget on the dot product's length
# (about one fetch-multiply-add group per element of K), so that the single pass is refused where
# the hardware refused it.
MAX_SHADER_K = 64


@dataclasses.dataclass(frozen=True)
class Render:
    passes: int
    fetches_per_output: int  # texels a fragment reads: 2 per element of K, plus the previous target


def fragment_shader(a_tex: torch.Tensor, b_tex: torch.Tensor, k0: int, k1: int,
                    previous: torch.Tensor | None = None) -> torch.Tensor:
    """Every pixel (i, j) of the target at once: ``previous[i, j]`` (when given) plus the sum over
    k in [k0, k1) of ``a_tex[i, k] * b_tex[k, j]``, one texel of each texture per k."""
    acc = previous.clone() if previous is not None else torch.zeros(a_tex.shape[0], b_tex.shape[1],
                                                                    dtype=a_tex.dtype, device=a_tex.device)
    for k in range(k0, k1):
        acc += a_tex[:, k:k + 1] * b_tex[k:k + 1, :]  # fetch A[i, k] and B[k, j] for every pixel
    return acc


def _check(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"need (M, K) and (K, N) textures, got {tuple(a.shape)} and {tuple(b.shape)}")


def render_single_pass(a: torch.Tensor, b: torch.Tensor, max_k: int = MAX_SHADER_K) -> tuple[torch.Tensor, Render]:
    """C = A @ B as one pass: the shader loops over all of K. Refused when K is longer than a
    shader may be (``max_k``)."""
    _check(a, b)
    k = a.shape[1]
    if k > max_k:
        raise ValueError(f"K = {k} needs a shader longer than the {max_k} steps allowed: render it in passes")
    return fragment_shader(a, b, 0, k), Render(passes=1, fetches_per_output=2 * k)


def render_multi_pass(a: torch.Tensor, b: torch.Tensor, k_per_pass: int) -> tuple[torch.Tensor, Render]:
    """C = A @ B in ``ceil(K / k_per_pass)`` passes over two ping-pong targets: pass p reads what
    pass p - 1 wrote (one more texel per fragment) and writes the other target."""
    _check(a, b)
    if k_per_pass < 1:
        raise ValueError(f"k_per_pass must be at least 1, got {k_per_pass}")
    k = a.shape[1]
    passes = max(1, math.ceil(k / k_per_pass))
    targets: list[torch.Tensor | None] = [None, None]
    for p in range(passes):
        read, write = p % 2, (p + 1) % 2
        targets[write] = fragment_shader(a, b, p * k_per_pass, min(k, (p + 1) * k_per_pass), previous=targets[read])
    return targets[passes % 2], Render(passes=passes, fetches_per_output=2 * k + passes - 1)


def tiled_loads_per_output(k: int, block_m: int, block_n: int) -> float:
    """Elements a tiled kernel loads from global memory per output: a ``block_m x block_n`` tile of
    C reads ``block_m x K`` of A and ``K x block_n`` of B once, shared by the tile's outputs."""
    return k * (1 / block_n + 1 / block_m)
