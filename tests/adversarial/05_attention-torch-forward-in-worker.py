# expect: flash_torch=rejected
# Doing the untiled work where the count does not look: the forward hands the whole N x N attention to a
# DataLoader worker process, away from the dispatch mode and hooks of the thread that counts, and tiles nothing.
# %% grade_id=attn_torch_code
import math

import torch


class _Attention(torch.utils.data.Dataset):
    def __init__(self, q, k, v, causal):
        self.q, self.k, self.v, self.causal = q, k, v, causal

    def __len__(self):
        return 1

    def __getitem__(self, i):
        qf, kf, vf = self.q.float(), self.k.float(), self.v.float()
        s = (qf @ kf.transpose(-2, -1)) * qf.shape[-1] ** -0.5
        if self.causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - lse[..., None]) @ vf, lse


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        loader = torch.utils.data.DataLoader(_Attention(q, k, v, causal), batch_size=None, num_workers=1)
        o, lse = next(iter(loader))
        ctx.save_for_backward(q, k, v, o, lse)
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
