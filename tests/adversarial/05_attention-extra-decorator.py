# expect: attention_fwd=not_a_kernel attention_speed=not_a_kernel
# Library instead of a kernel: a second decorator swaps the kernel for scaled_dot_product_attention.
# %% grade_id=attn_fwd_code
import torch.nn.functional as F
import triton
import triton.language as tl


def _swap(kernel):
    class Fake:
        fn = kernel.fn

        def __getitem__(self, grid):
            return lambda q, k, v, o, *rest, **kw: o.copy_(F.scaled_dot_product_attention(q, k, v))
    return Fake()


@_swap
@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    pass
