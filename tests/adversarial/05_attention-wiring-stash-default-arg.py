# expect: attention_memory=failed
# Pretending: the wiring keeps the N x N scores "for the backward" in a default argument's list, outside ctx and
# save_for_backward, where a count of saved tensors never looks.
# %% grade_id=attn_function_code
import torch

from fastdl_lab import attention


def _stash(t=None, _box=[]):
    if t is None:
        return _box.pop()
    _box.append(t)


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernels, config):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
        o3, lse = attention.launch_forward(kernels["fwd"], q3, k3, v3, causal, scale, config)
        ctx.save_for_backward(q3, k3, v3, o3, lse)
        _stash(q3 @ k3.transpose(-2, -1))
        ctx.causal, ctx.scale, ctx.kernels, ctx.config = causal, scale, kernels, config
        return o3.view(q.shape)

    @staticmethod
    def backward(ctx, do):
        q3, k3, v3, o3, lse = ctx.saved_tensors
        _stash()
        do3 = do.contiguous().view(o3.shape)
        grads = attention.launch_backward(ctx.kernels, q3, k3, v3, o3, lse, do3, ctx.causal, ctx.scale, ctx.config)
        return (*(g.view(do.shape) for g in grads), None, None, None, None)
