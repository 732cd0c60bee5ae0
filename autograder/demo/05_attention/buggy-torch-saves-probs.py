# A realistic mistake: the PyTorch FlashAttention keeps every block's probabilities "to save the
# backward a recomputation". Every result is right; what it saves is N x N again.
# %% grade_id=attn_torch_code
import math

import torch


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        qf, kf, vf = q.float(), k.float(), v.float()
        scale = q.shape[-1] ** -0.5
        n_q, n_k = q.shape[-2], k.shape[-2]
        rows = torch.arange(n_q, device=q.device)
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), device=q.device)
        blocks = []
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
            blocks.append(s)
        o = acc / l[..., None]
        lse = m + torch.log(l)
        probs = torch.exp(torch.cat(blocks, -1) - lse[..., None])
        ctx.save_for_backward(q, k, v, o, probs)
        ctx.block_n = block_n
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, probs = ctx.saved_tensors
        qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
        scale = q.shape[-1] ** -0.5
        delta = (dof * o).sum(-1)
        dq = torch.zeros_like(qf)
        dk, dv = torch.empty_like(kf), torch.empty_like(vf)
        for j0 in range(0, k.shape[-2], ctx.block_n):
            k_j, v_j = kf[..., j0:j0 + ctx.block_n, :], vf[..., j0:j0 + ctx.block_n, :]
            p = probs[..., j0:j0 + ctx.block_n]
            dv[..., j0:j0 + ctx.block_n, :] = p.transpose(-2, -1) @ dof
            ds = p * (dof @ v_j.transpose(-2, -1) - delta[..., None])
            dq += (ds @ k_j) * scale
            dk[..., j0:j0 + ctx.block_n, :] = (ds.transpose(-2, -1) @ qf) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
