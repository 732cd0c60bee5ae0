# expect: attention_memory=failed
# Saving little and spending it later: the wiring keeps only q, k, v and the output, and its backward does the
# gradients in PyTorch on the whole N x N probabilities instead of calling the backward kernels.
# %% grade_id=attn_function_code
import torch

from fastdl_lab import attention


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernels, config):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
        o3, lse = attention.launch_forward(kernels["fwd"], q3, k3, v3, causal, scale, config)
        ctx.save_for_backward(q3, k3, v3, o3)
        ctx.causal, ctx.scale = causal, scale
        return o3.view(q.shape)

    @staticmethod
    def backward(ctx, do):
        q3, k3, v3, o3 = ctx.saved_tensors
        do3 = do.contiguous().view(o3.shape)
        n = q3.shape[1]
        s = (q3 @ k3.transpose(-2, -1)) * ctx.scale
        if ctx.causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        dv = p.transpose(-2, -1) @ do3
        dp = do3 @ v3.transpose(-2, -1)
        ds = p * (dp - (do3 * o3).sum(-1, keepdim=True))
        dq = (ds @ k3) * ctx.scale
        dk = (ds.transpose(-2, -1) @ q3) * ctx.scale
        return dq.view(do.shape), dk.view(do.shape), dv.view(do.shape), None, None, None, None
