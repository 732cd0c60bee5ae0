"""The FlashAttention forward kernel (lab 05 attention) and its launch.

One program owns BLOCK_M query rows of one (batch, head) slice and walks the keys BLOCK_N at a
time, keeping the online-softmax state (running maximum, running sum, unnormalised output) in
registers. Scores exist only as a BLOCK_M x BLOCK_N tile: HBM sees q, k, v read and o written,
plus one fp32 logsumexp per row for the backward.

Masks are paid only where they change something: in causal attention the key blocks before the
diagonal run without any mask and only the diagonal block(s) compare key with query; bounds masks
exist only in kernels compiled for a length that is not a multiple of the tiles (``EVEN_N``).

Layout contract shared by every attention kernel: a (batch, heads, N, D) tensor is viewed as
Z = batch * heads slices of N rows of D contiguous elements; ``stride_z`` and ``stride_row`` are
the element distances between slices and between rows, the same for q, k, v, o and their
gradients (the launcher makes them so). Per-row fp32 vectors (logsumexp, delta) are (Z, N)
contiguous.
"""

from __future__ import annotations

import torch

from fastdl_lab import checks
from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale, lo, hi,
               CAUSAL_MASK: tl.constexpr, KEY_MASK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online-softmax steps over the key blocks lo, lo + BLOCK_N, ... < hi; returns (acc, l_i, m_i).

    The two flags are compile-time, so a block range that needs no mask compiles without one: no
    compare and no select per score, the bulk of a step's non-tensor-core instructions.
    """
    ### BEGIN SOLUTION
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # k is loaded as a HEAD_DIM x BLOCK_N tile, so that q @ k_t needs no transpose.
        k_ptrs = k_ptr + base + offs_n[None, :] * stride_row + offs_d[:, None]
        v_ptrs = v_ptr + base + offs_n[:, None] * stride_row + offs_d[None, :]
        if KEY_MASK:
            in_keys = offs_n < N
            k_t = tl.load(k_ptrs, mask=in_keys[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=in_keys[:, None], other=0.0)
        else:
            k_t = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, k_t) * qk_scale
        if CAUSAL_MASK:
            # For a row inside the sequence, key <= query also keeps the keys past N out.
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        elif KEY_MASK:
            s = tl.where(offs_n[None, :] < N, s, float("-inf"))
        # Every row sees key 0 in its first block (padded rows included), so m_new is finite from
        # the first step on and no exp2 ever sees -inf - (-inf).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        correction = tl.exp2(m_i - m_new)
        l_i = l_i * correction + tl.sum(p, axis=1)
        # P goes to the tensor cores in the inputs' precision, accumulating in fp32.
        acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])
        m_i = m_new
    return acc, l_i, m_i
    ### END SOLUTION


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                     CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                     EVEN_N: tl.constexpr = False):
    """Program (i, z): rows i*BLOCK_M ... of slice z; stores o and lse = log(sum_j exp(scale q.k_j)).

    ``EVEN_N``: N is a multiple of both tiles (the launcher knows), so no load or store needs a
    bounds mask.
    """
    ### BEGIN SOLUTION
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    base = z * stride_z
    q_ptrs = q_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :]
    if EVEN_N:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(offs_m < N)[:, None], other=0.0)

    # exp(x) = exp2(x log2 e), and exp2 is the GPU's native instruction: scores are scaled into
    # base-2 units once, so that each exponential is a bare exp2.
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    if CAUSAL:
        # Keys before the block's first query are seen by every row, and they lie inside the
        # sequence (that query does): those blocks take no mask at all. Only the block(s) on the
        # diagonal compare key with query; keys past the block's last query are seen by no row.
        diag = (start_m // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                                   0, diag, False, False, BLOCK_N)
        if EVEN_N:
            hi = start_m + BLOCK_M
        else:
            hi = tl.minimum(N, start_m + BLOCK_M)
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                                   diag, hi, True, not EVEN_N, BLOCK_N)
    else:
        # Whole key blocks need no mask; a ragged sequence ends with one block that does.
        if EVEN_N:
            full = N
        else:
            full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N, qk_scale,
                                   0, full, False, False, BLOCK_N)
        if not EVEN_N:
            acc, l_i, m_i = _fwd_steps(acc, l_i, m_i, q, k_ptr, v_ptr, base, stride_row, offs_m, offs_d, N,
                                       qk_scale, full, N, False, True, BLOCK_N)

    o = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    # Back to natural-log units: lse = (m + log2 l) / log2 e.
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634
    o_ptrs = o_ptr + base + offs_m[:, None] * stride_row + offs_d[None, :]
    if EVEN_N:
        tl.store(o_ptrs, o)
        tl.store(lse_ptr + z * N + offs_m, lse)
    else:
        in_rows = offs_m < N
        tl.store(o_ptrs, o, mask=in_rows[:, None])
        tl.store(lse_ptr + z * N + offs_m, lse, mask=in_rows)
    ### END SOLUTION


# Compile-time shape specialisations the package's kernels take and the lab's skeletons need not:
# the launchers pass each only to a kernel that declares it.
OPTIONAL_FLAGS = ("EVEN_N",)


def even_n(n: int, block_m: int, block_n: int) -> bool:
    """True when a sequence of ``n`` tokens fills whole query and key tiles: no bounds masks needed."""
    return n % block_m == 0 and n % block_n == 0


def declared(kernel, **flags) -> dict:
    """The ``flags`` that ``kernel`` takes as arguments.

    Shape specialisations such as ``EVEN_N`` are optional for a kernel: a kernel written to the
    lab's signature, which has none, is launched exactly as before.
    """
    fn = getattr(kernel, "fn", kernel)
    code = getattr(fn, "__code__", None)
    names = set(code.co_varnames[: code.co_argcount]) if code is not None else set()
    unknown = sorted(set(flags) - set(OPTIONAL_FLAGS))
    if unknown:
        raise ValueError(f"{unknown} are not optional kernel flags; those are {list(OPTIONAL_FLAGS)}")
    return {name: value for name, value in flags.items() if name in names}


def launch_forward(kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``kernel`` on (Z, N, D) tensors with one layout; returns o (like q) and the fp32 (Z, N) lse."""
    z, n, d = q.shape
    o = checks.output_buffer((z, n, d), q.dtype, q)
    lse = checks.output_buffer((z, n), torch.float32, q)
    if z and n:
        bm, bn = config["block_m"], config["block_n"]
        grid = (triton.cdiv(n, bm), z)
        kernel[grid](q, k, v, o, lse, q.stride(0), q.stride(1), n, scale,
                     CAUSAL=causal, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, **declared(kernel, EVEN_N=even_n(n, bm, bn)),
                     num_warps=config["num_warps"], num_stages=config["num_stages"])
    return o, lse
