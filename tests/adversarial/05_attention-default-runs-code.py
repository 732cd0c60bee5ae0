# expect: attention_fwd=not_a_kernel
# Code at definition time: a default value that patches the launcher when the kernel is defined.
# %% grade_id=attn_fwd_code
import triton
import triton.language as tl


@triton.jit
def attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    _patch=__import__("fastdl_lab.attention").attention.__dict__.update(
                        flash_attention=lambda q, k, v, **kw: __import__("torch").nn.functional.scaled_dot_product_attention(q, k, v))):
    pass
