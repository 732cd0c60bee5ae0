"""FlashAttention in plain PyTorch, forward and backward, as an autograd.Function (lab 05 attention).

The bridge between ``attention_tiled`` (the online softmax, forward only) and the Triton kernels:
the same algorithm, written with whole-tensor PyTorch operations so that every step can be
printed and checked, and wired into autograd the way the kernels are.

- Forward: every query at once, the keys ``block_n`` at a time, with the online softmax's
  running maximum, running sum and unnormalised output. Saved for the backward: q, k, v, the
  output O and one logsumexp per query row. Nothing N x N is saved, or even created: the largest
  tensor is a (..., N, block_n) tile of scores.
- Backward: the same walk over key blocks. Each block's probabilities are recomputed from q, k
  and the logsumexp, P = exp(scale q k^T - lse), exact and already normalised, and
  delta = rowsum(dO * O) stands in for the softmax Jacobian's row sums:

      dV_j = P_j^T dO    dP_j = dO V_j^T    dS_j = P_j * (dP_j - delta)
      dQ  += scale dS_j K_j                 dK_j = scale dS_j^T Q

Computed in fp32 (fp64 for fp64 inputs), returned in the inputs' dtype, like ``attention_tiled``.
"""

from __future__ import annotations

import torch

from fastdl_lab.attention.inputs import check_qkv, resolve_causal

# A tile of 64 keys: large enough that PyTorch's per-operation overhead stays small next to the
# work, small enough that the (N, block) tiles stay far below N x N at any real length.
DEFAULT_BLOCK_N = 64


class FlashAttentionTorch(torch.autograd.Function):
    """``apply(q, k, v, causal, block_n)`` on (..., tokens, head_dim) tensors; scale 1/sqrt(head_dim)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        ### BEGIN SOLUTION
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        qc, kc, vc = (t.to(compute) for t in (q, k, v))
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[-2], k.shape[-2]
        rows = torch.arange(n_q, device=q.device)
        m = torch.full(q.shape[:-1], float("-inf"), dtype=compute, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=compute, device=q.device)
        for j0 in range(0, n_k, block_n):
            k_j, v_j = kc[..., j0:j0 + block_n, :], vc[..., j0:j0 + block_n, :]
            s = (qc @ k_j.transpose(-2, -1)) * scale
            if causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            # Key 0 is in the first block and every row sees it, so m is finite from then on and a
            # fully masked later block gives exp(-inf - m) = 0, never NaN.
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + p @ v_j
            m = m_new
        o = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.block_n = causal, block_n
        return o.to(q.dtype)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        ### BEGIN SOLUTION
        q, k, v, o, lse = ctx.saved_tensors
        compute = o.dtype
        qc, kc, vc, doc = (t.to(compute) for t in (q, k, v, do))
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[-2], k.shape[-2]
        rows = torch.arange(n_q, device=q.device)
        delta = (doc * o).sum(-1)
        dq = torch.zeros_like(qc)
        dk, dv = torch.empty_like(kc), torch.empty_like(vc)
        for j0 in range(0, n_k, ctx.block_n):
            k_j, v_j = kc[..., j0:j0 + ctx.block_n, :], vc[..., j0:j0 + ctx.block_n, :]
            s = (qc @ k_j.transpose(-2, -1)) * scale
            if ctx.causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            p = torch.exp(s - lse[..., None])
            dv[..., j0:j0 + ctx.block_n, :] = p.transpose(-2, -1) @ doc
            ds = p * (doc @ v_j.transpose(-2, -1) - delta[..., None])
            dq += (ds @ k_j) * scale
            dk[..., j0:j0 + ctx.block_n, :] = (ds.transpose(-2, -1) @ qc) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
        ### END SOLUTION


def flash_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool | None = None,
                          is_causal: bool | None = None, block_n: int = DEFAULT_BLOCK_N,
                          function: type[torch.autograd.Function] | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) v by ``FlashAttentionTorch``, differentiable in q, k and v.

    q, k, v: (batch, heads, tokens, head_dim) or (batch, tokens, head_dim), one dtype and device;
    any number of keys (as many as queries when ``causal`` / ``is_causal``). ``block_n``: keys per
    tile. ``function`` replaces ``FlashAttentionTorch`` (lab 05 has students write their own); it
    is applied to ``(q, k, v, causal, block_n)``.
    """
    causal = resolve_causal(causal, is_causal)
    check_qkv(q, k, v, self_attention=False, causal=causal)
    if not q.is_floating_point():
        raise ValueError(f"attention needs floating-point inputs, got {q.dtype}")
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int, got {block_n!r}")
    return (function or FlashAttentionTorch).apply(q, k, v, causal, block_n)

