"""Attention in plain PyTorch (lab 05 attention): the specification, the tiled online-softmax
version that the Triton kernels follow, and the arithmetic of what each one moves and computes.

Every function takes (batch, heads, tokens, head_dim) tensors, the layout of
``F.scaled_dot_product_attention``. ``scale`` defaults to 1/sqrt(head_dim).
"""

from __future__ import annotations

import math

import torch


def _scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def causal_mask(n_q: int, n_k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """True where query i may attend key j: j <= i."""
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  scale: float | None = None) -> torch.Tensor:
    """softmax(scale * q k^T) v, materialising the N x N scores and probabilities: the specification.

    Computed in fp32 (fp64 for fp64 inputs) and returned in q's dtype. With ``causal`` query i
    attends keys 0..i, which needs as many queries as keys.
    """
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    compute = _compute_dtype(q)
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    scores = torch.matmul(qc, kc.transpose(-2, -1)) * _scale(q.shape[-1], scale)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vc).to(q.dtype)


def attention_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Attention as hand-written model code computes it: three kernels in the inputs' own precision.

    The speed baseline on a GPU (``attention_ref`` computes in fp32 for accuracy, which would make
    fp16 timings unfair); its memory traffic is ``attention_bytes(..., method="naive")``.
    """
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    scores = torch.matmul(q, k.transpose(-2, -1)) * _scale(q.shape[-1], scale)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def logsumexp_ref(q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Per query row, log(sum_j exp(scale * q.k_j)) in fp32 (fp64 for fp64): what the forward kernel saves."""
    compute = _compute_dtype(q)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * _scale(q.shape[-1], scale)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    scale: float | None = None, block_m: int = 64, block_n: int = 64,
                    return_lse: bool = False):
    """The FlashAttention forward in PyTorch: one query block at a time, one key block at a time.

    No row of probabilities is ever complete. Each query row keeps a running maximum ``m``, a
    running sum ``l`` of exp(score - m) and an unnormalised output ``acc``; a new key block that
    raises the maximum scales the old ``l`` and ``acc`` down by exp(m_old - m_new) before adding
    its own terms, and the division by ``l`` happens once at the end. With ``return_lse`` also
    returns m + log(l), the row's logsumexp, which is all the backward needs to rebuild any
    probability.
    """
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs as many queries as keys, got {q.shape[-2]} and {k.shape[-2]}")
    compute = _compute_dtype(q)
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    n_q, n_k = q.shape[-2], k.shape[-2]
    sm_scale = _scale(q.shape[-1], scale)
    out = torch.empty(qc.shape[:-1] + (v.shape[-1],), dtype=compute, device=q.device)
    lse = torch.empty(qc.shape[:-1], dtype=compute, device=q.device)
    for i0 in range(0, n_q, block_m):
        q_blk = qc[..., i0:i0 + block_m, :]
        rows = torch.arange(i0, i0 + q_blk.shape[-2], device=q.device)
        m = torch.full(q_blk.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(q_blk.shape[:-1] + (v.shape[-1],), dtype=compute, device=q.device)
        # Causal: key blocks that start after this block's last query contribute nothing.
        stop = min(n_k, i0 + block_m) if causal else n_k
        for j0 in range(0, stop, block_n):
            s = torch.matmul(q_blk, kc[..., j0:j0 + block_n, :].transpose(-2, -1)) * sm_scale
            if causal:
                cols = torch.arange(j0, j0 + s.shape[-1], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            # Key 0 is in the first block of every row, so m_new is finite from the first step on
            # and exp(-inf - m_new) is a clean 0, never NaN.
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + torch.matmul(p, vc[..., j0:j0 + block_n, :])
            m = m_new
        out[..., i0:i0 + block_m, :] = acc / l[..., None]
        lse[..., i0:i0 + block_m] = m + torch.log(l)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def attention_bytes(n: int, d: int, itemsize: int, *, method: str = "naive", batch_heads: int = 1,
                    block_m: int | None = None) -> int:
    """Bytes a forward pass moves to and from the GPU's main memory (HBM), for N tokens of head dim d.

    ``"naive"``: three kernels, as in PyTorch eager: S = q k^T is written (N x N), softmax reads
    S and writes P (N x N), P v reads P. Besides the N x d reads of q, k, v and the write of o,
    that is four N x N passes, in the inputs' precision.

    ``"flash"``: q, k, v read and o written once, plus the fp32 logsumexp of each row, which
    assumes that the re-reads of k and v by every query block hit the L2 cache. Given ``block_m``,
    each of the cdiv(N, block_m) query blocks is instead charged a full read of k and v from
    memory: the no-cache bound, N^2 d / block_m elements, as in the FlashAttention paper's analysis.
    """
    per_head_io = 4 * n * d * itemsize
    if method == "naive":
        total = per_head_io + 4 * n * n * itemsize
    elif method == "flash":
        total = per_head_io + 4 * n
        if block_m is not None:
            total += 2 * n * d * itemsize * (math.ceil(n / block_m) - 1)
    else:
        raise ValueError(f"method must be 'naive' or 'flash', got {method!r}")
    return batch_heads * total


def attention_flops(n: int, d: int, *, batch_heads: int = 1, causal: bool = False, backward: bool = False) -> float:
    """Matmul FLOPs of attention, the figure TFLOP/s are computed from (the usual convention).

    Forward: q k^T and P v, 2 N^2 d each. The backward does five such products (recomputing q k^T,
    then dV, dP, dQ and dK), 2.5 x the forward; with ``backward`` the result is forward plus
    backward. Causal attention does about half of each.
    """
    forward = 4 * n * n * d * batch_heads * (0.5 if causal else 1.0)
    return forward * (3.5 if backward else 1.0)
