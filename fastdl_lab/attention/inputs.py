"""What the attention functions of lab 05 accept, and the errors for what they do not.

People pass attention inputs the way ``F.scaled_dot_product_attention`` takes them:
(batch, heads, tokens, head_dim), or (batch, tokens, head_dim) for a single head, with
``is_causal=``. Whatever the kernels cannot compute (cross-attention, grouped heads, a mask,
dropout, an odd head dim) is refused up front with an ``UnsupportedAttentionError`` that says what
to do instead, never left to fail later as a reshape or a Triton compile error.
"""

from __future__ import annotations

import torch


class UnsupportedAttentionError(ValueError):
    """Attention these functions do not compute; the message names the input and the way round it."""


LAYOUTS = "(batch, heads, tokens, head_dim) or (batch, tokens, head_dim)"


def resolve_causal(causal, is_causal) -> bool:
    """One flag from ``causal=`` (the course's name) or ``is_causal=`` (PyTorch's); None means not given."""
    for name, value in (("causal", causal), ("is_causal", is_causal)):
        # By equality: 0 / 1 and NumPy booleans pass, a string does not.
        if value is not None and value not in (True, False):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if causal is not None and is_causal is not None and bool(causal) != bool(is_causal):
        raise ValueError(f"causal={causal!r} and is_causal={is_causal!r} disagree: pass only one of them")
    chosen = causal if causal is not None else is_causal
    return bool(chosen) if chosen is not None else False


def refuse_options(attn_mask, dropout_p) -> None:
    """The ``F.scaled_dot_product_attention`` options the kernels have no code for."""
    if attn_mask is not None:
        raise UnsupportedAttentionError(
            "attn_mask is not supported: the kernels compute full attention or, with is_causal=True, causal "
            "attention; for any other mask use F.scaled_dot_product_attention")
    if dropout_p != 0.0:
        raise UnsupportedAttentionError(f"dropout_p={dropout_p!r} is not supported: these kernels have no dropout; "
                                        "apply dropout outside attention or use F.scaled_dot_product_attention")


def check_qkv(q, k, v, *, head_dims: tuple[int, ...] | None = None, self_attention: bool = True,
              causal: bool = False) -> None:
    """Raise unless q, k, v are one layout, dtype and device, with shapes that agree.

    ``head_dims``: the only head sizes allowed (None: any). ``self_attention``: as many queries as
    keys, which the Triton kernels need; causal attention always does.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() not in (3, 4):
            raise UnsupportedAttentionError(f"{name} has shape {tuple(t.shape)}: expected {LAYOUTS}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"q is {q.dim()}-D but {name} is {t.dim()}-D: pass all three as {LAYOUTS}")
        if t.dtype != q.dtype:
            raise ValueError(f"q is {q.dtype} but {name} is {t.dtype}; cast one of them first")
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {t.device}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"q has batch {q.shape[0]} but {name} has batch {t.shape[0]}")
        if q.dim() == 4 and t.shape[1] != q.shape[1]:
            raise UnsupportedAttentionError(
                f"q has {q.shape[1]} heads but {name} has {t.shape[1]}: grouped-query attention is not supported; "
                f"repeat k and v to {q.shape[1]} heads first (k.repeat_interleave(heads_q // heads_kv, dim=1))")
    n_q, n_k, n_v = q.shape[-2], k.shape[-2], v.shape[-2]
    if n_k != n_v:
        raise ValueError(f"k has {n_k} keys but v has {n_v} values: every key needs its value")
    if n_q != n_k and (self_attention or causal):
        why = "causal attention lets query i see keys 0..i" if causal else \
            "these kernels compute self-attention, one key per query position"
        raise UnsupportedAttentionError(
            f"{n_q} queries but {n_k} keys: {why}, so n_queries must equal n_keys; for cross-attention use "
            "F.scaled_dot_product_attention or attention.attention_ref")
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    if d_k != d_q:
        raise ValueError(f"q has head_dim {d_q} but k has {d_k}: q . k needs one head_dim")
    if head_dims is not None:
        if d_v != d_q:
            raise UnsupportedAttentionError(f"v has head_dim {d_v} but q has {d_q}: the kernels use one HEAD_DIM "
                                            "for q, k and v; pad v with zero columns and slice the output")
        if d_q not in head_dims:
            raise UnsupportedAttentionError(
                f"head_dim {d_q} is not supported: the kernels take {head_dims} (tl.dot needs a power of two >= 16, "
                f"and past 128 the tiles no longer fit a GPU's registers); pad q, k and v with zeros to the next "
                f"size, pass scale={d_q}**-0.5 and slice the output")
