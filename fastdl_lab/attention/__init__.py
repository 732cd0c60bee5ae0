"""FlashAttention: attention without the N x N matrix (lab 05 attention).

Naive attention writes the N x N scores and probabilities to memory and reads them back, and
autograd keeps the probabilities for the backward: traffic and memory quadratic in the sequence
length. FlashAttention (Dao et al., 2022; FlashAttention-2, Dao, 2023) computes the same result
tile by tile with an online softmax and recomputes the tiles in the backward, so both stay linear.

- ``reference``: ``attention_ref`` (the specification), ``attention_naive`` (the speed baseline),
  ``attention_tiled`` (the online softmax in PyTorch), ``attention_bytes`` and ``attention_flops``;
- ``torch_flash``: ``FlashAttentionTorch``, forward and backward in plain PyTorch as an
  ``autograd.Function``, and ``flash_attention_torch``;
- ``inputs``: what the functions accept, and ``UnsupportedAttentionError`` for what they do not;
- ``forward`` / ``backward``: the Triton kernels and their launches;
- ``function``: ``flash_attention`` and its ``FlashAttentionFunction``, ``backward_parts`` (each
  backward kernel on its own), the check rules ``check_attention`` / ``check_attention_grads``,
  and ``compiled`` / ``ptx``, each kernel built for sm_80 / sm_90 at the launcher's configuration;
- ``bench``: the benchmark spec, ``benchmark`` and ``check``.
"""

from fastdl_lab.attention.reference import (attention_bytes, attention_flops, attention_naive, attention_ref,
                                            attention_tiled, causal_mask, logsumexp_ref)
from fastdl_lab.attention.inputs import UnsupportedAttentionError
from fastdl_lab.attention.torch_flash import FlashAttentionTorch, flash_attention_torch
from fastdl_lab.attention.forward import OPTIONAL_FLAGS, _attn_fwd_kernel, launch_forward
from fastdl_lab.attention.backward import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel,
                                           launch_backward, launch_backward_dkdv, launch_backward_dq)
from fastdl_lab.attention.function import (BWD_KEYS, GRAD_RTOL, HEAD_DIMS, KERNELS, STUDENT_KERNELS,
                                           FlashAttentionFunction, backward_parts, check_attention,
                                           check_attention_grads, compiled, default_config, flash_attention,
                                           kernel_written, ptx)
from fastdl_lab.attention.bench import BENCHMARK, benchmark, check
