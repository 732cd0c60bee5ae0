"""Shapes tensor cores like (lab 01 gemm, section 8): the alignment rules, and padding a vocabulary.

Tensor cores multiply fixed-size tiles, and the libraries that feed them load operands in 16-byte
vectors. NVIDIA's *Matrix Multiplication Background* guide (Table 1) gives the rule per type for
M, N and K: with cuBLAS before 11.0, tensor cores were used only for multiples of 16 bytes (8
fp16 elements); since 11.0 they are always used, but most efficiently for multiples of 16 bytes,
and on an A100 of 128 bytes (64 fp16 elements). A dimension off by one (K = 4095) breaks the
alignment of every row after the first.

- ``ALIGN_BYTES`` / ``BEST_BYTES`` and ``multiple_for``: the rule in elements for a dtype;
- ``round_up`` and ``aligned``: the arithmetic;
- ``pad_embedding`` / ``PaddedLMHead`` (``pad_lm_head``): a vocabulary padded to a multiple of 64,
  the padded rows never looked up and their logits sliced off, so the model computes the same.
"""

from __future__ import annotations

import torch
from torch import nn

# The guide's Table 1 in bytes: fp16 "multiples of 8; on A100, multiples of 64", TF32 4 and 32,
# INT8 16 and 128, FP64 2 and 16. The rule is one of bytes; bf16 is a 2-byte type like fp16.
ALIGN_BYTES = 16
BEST_BYTES = 128
# What the tensor core sees of each storage type: fp32 inputs run on them as TF32 (4 bytes).
_ELEMENT_BYTES = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.int8: 1, torch.float64: 8}


def multiple_for(dtype: torch.dtype, best: bool = False) -> int:
    """Elements per 16 bytes (``best=False``) or per 128 bytes (``best=True``) of ``dtype``."""
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"no tensor-core rule for {dtype}; known: {sorted(map(str, _ELEMENT_BYTES))}")
    return (BEST_BYTES if best else ALIGN_BYTES) // _ELEMENT_BYTES[dtype]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``n``."""
    if n < 0 or multiple < 1:
        raise ValueError(f"round_up needs n >= 0 and multiple >= 1, got {n}, {multiple}")
    return -(-n // multiple) * multiple


def aligned(m: int, n: int, k: int, dtype: torch.dtype = torch.float16) -> dict[str, dict[str, bool]]:
    """For each of M, N, K: is it a multiple of 16 bytes, and of 128 bytes, in ``dtype``."""
    align, best = multiple_for(dtype), multiple_for(dtype, best=True)
    return {name: {"16 B": size % align == 0, "128 B": size % best == 0}
            for name, size in (("M", m), ("N", n), ("K", k))}


def pad_embedding(embedding: nn.Embedding, multiple: int = 64) -> nn.Embedding:
    """A copy of ``embedding`` with its rows padded with zeros to a multiple of ``multiple``. Token
    ids stay below the original vocabulary, so the new rows are never looked up."""
    vocab, dim = embedding.weight.shape
    padded = nn.Embedding(round_up(vocab, multiple), dim, padding_idx=embedding.padding_idx,
                          device=embedding.weight.device, dtype=embedding.weight.dtype)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[:vocab] = embedding.weight
    return padded


class PaddedLMHead(nn.Module):
    """An output projection computed over a padded vocabulary and sliced back to the real one.

    The matmul's N dimension is the padded size (a multiple of 64: aligned tiles, no ragged last
    tile on 128-byte boundaries); the logits the caller sees have the original width, so a softmax
    or a loss over them is unchanged. The padded rows are zero and receive no gradient.
    """

    def __init__(self, head: nn.Linear, multiple: int = 64):
        super().__init__()
        self.vocab = head.out_features
        self.proj = nn.Linear(head.in_features, round_up(self.vocab, multiple), bias=head.bias is not None,
                              device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:self.vocab] = head.weight
            if head.bias is not None:
                self.proj.bias.zero_()
                self.proj.bias[:self.vocab] = head.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[..., :self.vocab]


def pad_lm_head(head: nn.Linear, multiple: int = 64) -> PaddedLMHead:
    """``head`` with its vocabulary padded to a multiple of ``multiple`` and its logits sliced back."""
    return PaddedLMHead(head, multiple)


def k_alignment_operands(k: int, m: int = 256, n: int = 256, dtype: torch.dtype = torch.float32, dev: str = "cpu",
                         seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major ``m x k`` and ``k x n`` operands: with an odd ``k`` every row of A starts off the
    16-byte boundaries the first one is on (the experiment of K = 4095 against 4096)."""
    from fastdl_lab import checks

    return (checks.randn(m, k, dtype=dtype, seed=seed, device=dev),
            checks.randn(k, n, dtype=dtype, seed=seed + 1, device=dev))
