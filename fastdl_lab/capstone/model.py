"""A small decoder-only transformer whose LayerNorm and attention can each be swapped (lab 10).

The model is GPT-2's layout at any size: token and position embeddings, ``n_layer`` pre-norm blocks
(LayerNorm, causal self-attention, residual; LayerNorm, a 4x MLP with GELU, residual), a last
LayerNorm and an output projection tied to the token embedding. What makes it the capstone's is
that its two kernels of the course are parameters:

- ``layernorm``: a function ``(x, weight, bias, eps) -> y`` over the last dimension;
- ``attention``: a function ``(q, k, v) -> o`` on ``(batch, heads, tokens, head_dim)``, causal.

``LAYER_NORMS`` and ``ATTENTIONS`` name the ones the package has: ``"torch"`` (what a user calls;
for attention also ``"math"``, the definition written out, every matmul visible to a profiler),
``"course-pytorch"`` (the course's algorithm in plain PyTorch: lab 03's reference, lab 05's
FlashAttention ``autograd.Function``; no Triton, so it trains at CPU speed) and
``"course-triton"`` (labs 03 and 05's Triton kernels: the GPU path; on a CPU the interpreter runs
them, seconds per call, fit for a parity check at a small size and not for training). A student's
own function is passed the same way. Two models built from one config and one seed have equal
weights whatever their parts, so any difference in their outputs is the parts'.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

LayerNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model's sizes; ``vocab_size`` 256 reads bytes, so no tokenizer is needed."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_head: int = 4
    n_layer: int = 4
    mlp_ratio: int = 4
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_head", "n_layer", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# A CPU trains this in minutes (about 0.8 M parameters); the GPU size is GPT-2 medium's shape
# (about 350 M parameters, 1024 tokens), with the vocabulary padded to a multiple of 64 (lab 01).
CPU_CONFIG = GPTConfig()
GPU_CONFIG = GPTConfig(vocab_size=50304, seq_len=1024, d_model=1024, n_head=16, n_layer=24)


def _torch_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def _course_pytorch_layer_norm(x, weight, bias, eps):
    from fastdl_lab import layernorm

    return layernorm.layer_norm_ref(x, weight, bias, eps)


def _course_triton_layer_norm(x, weight, bias, eps):
    from fastdl_lab import layernorm

    return layernorm.layer_norm(x, weight, bias, eps)


def _torch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _math_attention(q, k, v):
    """Attention as its definition writes it: scores, a causal mask, softmax, a weighted sum. The
    T x T matrix is made and kept, as lab 05's naive attention does; every matmul is visible to a
    FLOP counter and a profiler (torch's fused kernel is one opaque op to both)."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(dim=-1) @ v


def _course_pytorch_attention(q, k, v):
    from fastdl_lab.attention.torch_flash import flash_attention_torch

    return flash_attention_torch(q, k, v, is_causal=True)


def _course_triton_attention(q, k, v):
    from fastdl_lab.attention.function import flash_attention

    return flash_attention(q, k, v, is_causal=True)


LAYER_NORMS: dict[str, LayerNormFn] = {"torch": _torch_layer_norm, "course-pytorch": _course_pytorch_layer_norm,
                                       "course-triton": _course_triton_layer_norm}
ATTENTIONS: dict[str, AttentionFn] = {"torch": _torch_attention, "math": _math_attention,
                                      "course-pytorch": _course_pytorch_attention,
                                      "course-triton": _course_triton_attention}


def _resolve(choice, table: dict, what: str):
    if callable(choice):
        return choice
    if choice in table:
        return table[choice]
    raise ValueError(f"{what} must be one of {sorted(table)} or a function, got {choice!r}")


def usable_part(kind: str, choice) -> tuple[object, str]:
    """``(choice, what it is)`` where the part runs here, else ``("torch", why not)``. The student
    copy of the package leaves the course's graded exercises to the student (lab 05's attention,
    in PyTorch and in Triton, is a stub that raises ``NotImplementedError``): a student who has not
    pasted their own gets torch's part, and is told so."""
    table = {"layernorm": LAYER_NORMS, "attention": ATTENTIONS}[kind]
    if callable(choice):
        return choice, "your own function"
    part = _resolve(choice, table, kind)
    x = torch.randn(1, 2, 4, 8, device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        part(x, x, x) if kind == "attention" else part(x, torch.ones_like(x[0, 0, 0]), torch.zeros_like(x[0, 0, 0]), 1e-5)
    except NotImplementedError:
        return "torch", (f"torch's: the package's {choice!r} is a graded exercise, left out of your copy of the "
                         f"package; pass your own function to use yours")
    return choice, f"the package's {choice!r}"


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s parameters (``weight``, ``bias``) with the normalisation done by ``fn``."""

    def __init__(self, d: int, fn: LayerNormFn, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.fn, self.eps = fn, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, fn: AttentionFn):
        super().__init__()
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.n_head, self.fn = config.n_head, fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> three (b, heads, t, head_dim), the layout every attention of the course takes.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        o = self.fn(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig, layernorm: LayerNormFn, attention: AttentionFn):
        super().__init__()
        self.ln1 = LayerNorm(config.d_model, layernorm, config.eps)
        self.attn = CausalSelfAttention(config, attention)
        self.ln2 = LayerNorm(config.d_model, layernorm, config.eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``forward(idx, targets=None)`` returns the logits and, given targets, the mean cross-entropy."""

    def __init__(self, config: GPTConfig, layernorm: LayerNormFn, attention: AttentionFn, block: type | None = None):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        # ``block``: a class with ``Block``'s constructor and parameter names (lab 10's exercise).
        self.blocks = nn.ModuleList((block or Block)(config, layernorm, attention) for _ in range(config.n_layer))
        self.ln_f = LayerNorm(config.d_model, layernorm, config.eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied, as in GPT-2: one matrix, two uses
        # Activation checkpointing: the first ``recompute_blocks`` blocks keep only their input for
        # the backward and run their forward again there (lab 02's recompute-instead-of-save).
        self.recompute_blocks = 0
        # Mixed precision: each forward (and so the loss) under a ``torch.autocast`` of its own in
        # this dtype; the backward follows the forward's dtypes. One context per forward matters:
        # autocast caches the low-precision copies of the weights until its context exits, so a
        # context held across steps would feed every later forward the first step's weights (a
        # bf16 run held that way over 20 steps ended at a loss of 5.22 where fp32 reached 3.38).
        self.autocast_dtype: torch.dtype | None = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if self.autocast_dtype is None:
            return self._forward(idx, targets)
        with torch.autocast(device_type=idx.device.type, dtype=self.autocast_dtype):
            return self._forward(idx, targets)

    def _forward(self, idx: torch.Tensor, targets: torch.Tensor | None):
        b, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"{t} tokens, the model has positions for {self.config.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for i, block in enumerate(self.blocks):
            if i < self.recompute_blocks and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def _initialise(model: GPT, seed: int) -> None:
    """GPT-2's scheme from one generator: weights N(0, 0.02), the two projections into the
    residual stream N(0, 0.02 / sqrt(2 n_layer)) so that the stream's variance does not grow with
    depth, biases 0, LayerNorms 1 and 0."""
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.n_layer)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                std = residual_std if name.endswith("proj.weight") else 0.02
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build(config: GPTConfig = CPU_CONFIG, *, layernorm="torch", attention="torch", seed: int = 0,
          device: str | torch.device = "cpu", block: type | None = None) -> GPT:
    """The model with the named (or given) parts; the same ``config`` and ``seed`` give the same
    weights. ``block`` replaces ``Block`` by a class with its constructor and parameter names (a
    student's): the weights are drawn by name, so they are the same too."""
    model = GPT(config, _resolve(layernorm, LAYER_NORMS, "layernorm"), _resolve(attention, ATTENTIONS, "attention"),
                block)
    _initialise(model, seed)
    return model.to(device)


def param_count(config: GPTConfig) -> int:
    """Parameters, the tied output projection counted once: embeddings ``(V + T) d``; per block
    ``12 d**2 + 13 d`` with the 4x MLP (qkv 3d^2 + 3d, proj d^2 + d, fc 4d^2 + 4d, proj 4d^2 + d, two
    LayerNorms 4d), in general ``(4 + 2 r) d**2 + (9 + r) d`` for MLP ratio r; the last LayerNorm 2d."""
    d, r = config.d_model, config.mlp_ratio
    per_block = (4 + 2 * r) * d * d + (9 + r) * d
    return (config.vocab_size + config.seq_len) * d + config.n_layer * per_block + 2 * d


def matmul_flops_per_token(config: GPTConfig, tokens: int | None = None) -> dict[str, int]:
    """Forward FLOPs per token of the matrix multiplies, 2 per multiply-add: ``linear`` (every
    nn.Linear including the output projection) and ``attention`` (scores ``q k^T`` and ``P v``, over
    all ``tokens`` keys as the usual convention counts them, though the causal half is masked). A
    training step costs about three times the forward (the backward computes two products per
    forward one)."""
    d, r, t = config.d_model, config.mlp_ratio, tokens or config.seq_len
    linear = 2 * (config.n_layer * (4 + 2 * r) * d * d + d * config.vocab_size)
    attention = 2 * config.n_layer * 2 * t * d
    return {"linear": linear, "attention": attention, "total": linear + attention}
