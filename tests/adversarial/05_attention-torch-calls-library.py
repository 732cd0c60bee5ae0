# expect: flash_torch=rejected attention_bwd_dq=not_a_kernel
# Library instead of the work: the PyTorch Function hands attention to F.scaled_dot_product_attention (and
# its gradients to autograd), and the dQ "kernel" calls torch.
# %% grade_id=attn_torch_code
import torch
import torch.nn.functional as F


class FlashAttentionTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, block_n):
        ctx.save_for_backward(q, k, v)
        ctx.causal = causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*leaves, is_causal=ctx.causal)
            return (*torch.autograd.grad(o, leaves, do), None, None)
# %% grade_id=attn_bwd_dq_code
import torch
import triton
import triton.language as tl


@triton.jit
def attn_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                       CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_DIM: tl.constexpr):
    torch.matmul(q_ptr, k_ptr)
