"""FlashAttention: attention without the N x N matrix (lab 05 attention).

Naive attention writes the N x N scores and probabilities to memory and reads them back, and
autograd keeps the probabilities for the backward: traffic and memory quadratic in the sequence
length. FlashAttention (Dao et al., 2022; FlashAttention-2, Dao, 2023) computes the same result
tile by tile with an online softmax and recomputes the tiles in the backward, so both stay linear.

- ``reference``: ``attention_ref`` (the specification), ``attention_naive`` (the speed baseline),
  ``attention_tiled`` (the online softmax in PyTorch), ``attention_bytes`` and ``attention_flops``;
- ``forward`` / ``backward``: the Triton kernels and their launches;
- ``function``: ``flash_attention`` and its ``FlashAttentionFunction``, the check rules
  ``check_attention`` / ``check_attention_grads``, and ``ptx``;
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.
"""

from fastdl_lab.attention.reference import (attention_bytes, attention_flops, attention_naive, attention_ref,
                                            attention_tiled, causal_mask, logsumexp_ref)
from fastdl_lab.attention.forward import _attn_fwd_kernel, launch_forward
from fastdl_lab.attention.backward import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel, launch_backward
from fastdl_lab.attention.function import (BWD_KEYS, GRAD_RTOL, HEAD_DIMS, KERNELS, STUDENT_KERNELS,
                                           FlashAttentionFunction, check_attention, check_attention_grads,
                                           default_config, flash_attention, ptx)
from fastdl_lab.attention.bench import BENCHMARK, benchmark, check
