# expect: flash_torch=partial
# Pretending: a tiled PyTorch FlashAttention that also keeps the N x N probabilities as a ctx attribute,
# where saved-tensor hooks never look.
# %% grade_id=attn_torch_code
import math

import torch


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        # The running state is fp32 whatever the inputs' dtype.
        qf, kf, vf = q.float(), k.float(), v.float()
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[-2], k.shape[-2]
        rows = torch.arange(n_q, device=q.device)
        scores = []
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), device=q.device)
        for j0 in range(0, n_k, block_n):
            k_j, v_j = kf[..., j0:j0 + block_n, :], vf[..., j0:j0 + block_n, :]
            s = (qf @ k_j.transpose(-2, -1)) * scale
            if causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            correction = torch.exp(m - m_new)
            l = l * correction + p.sum(-1)
            acc = acc * correction[..., None] + p @ v_j
            m = m_new
            scores.append(s)
        o = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.probs = torch.exp(torch.cat(scores, -1) - lse[..., None])
        ctx.causal, ctx.block_n = causal, block_n
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
        scale = q.shape[-1] ** -0.5
        rows = torch.arange(q.shape[-2], device=q.device)
        block_n = ctx.block_n
        delta = (dof * o).sum(-1)
        dq = torch.zeros_like(qf)
        dk, dv = torch.empty_like(kf), torch.empty_like(vf)
        for j0 in range(0, k.shape[-2], block_n):
            k_j, v_j = kf[..., j0:j0 + block_n, :], vf[..., j0:j0 + block_n, :]
            s = (qf @ k_j.transpose(-2, -1)) * scale
            if ctx.causal:
                cols = torch.arange(j0, j0 + k_j.shape[-2], device=q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            p = torch.exp(s - lse[..., None])
            dv[..., j0:j0 + block_n, :] = p.transpose(-2, -1) @ dof
            ds = p * (dof @ v_j.transpose(-2, -1) - delta[..., None])
            dq += (ds @ k_j) * scale
            dk[..., j0:j0 + block_n, :] = (ds.transpose(-2, -1) @ qf) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
