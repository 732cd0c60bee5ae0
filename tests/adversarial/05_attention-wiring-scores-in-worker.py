# expect: attention_memory=failed
# Hiding the N x N scores in another process: a DataLoader worker computes them as soon as the forward makes its
# iterator, and the backward fetches them; the forward's own process never saves more than O(N).
# %% grade_id=attn_function_code
import torch

from fastdl_lab import attention


class _Scores(torch.utils.data.Dataset):
    def __init__(self, q3, k3):
        self.q3, self.k3 = q3, k3

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return self.q3 @ self.k3.transpose(-2, -1)


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernels, config):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
        o3, lse = attention.launch_forward(kernels["fwd"], q3, k3, v3, causal, scale, config)
        ctx.save_for_backward(q3, k3, v3, o3, lse)
        ctx.scores = iter(torch.utils.data.DataLoader(_Scores(q3.detach(), k3.detach()), batch_size=None,
                                                      num_workers=1))
        ctx.causal, ctx.scale, ctx.kernels, ctx.config = causal, scale, kernels, config
        return o3.view(q.shape)

    @staticmethod
    def backward(ctx, do):
        q3, k3, v3, o3, lse = ctx.saved_tensors
        next(ctx.scores)
        do3 = do.contiguous().view(o3.shape)
        grads = attention.launch_backward(ctx.kernels, q3, k3, v3, o3, lse, do3, ctx.causal, ctx.scale, ctx.config)
        return (*(g.view(do.shape) for g in grads), None, None, None, None)
