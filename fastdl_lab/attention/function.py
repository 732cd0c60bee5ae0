"""FlashAttention as a differentiable PyTorch function (lab 05 attention): validation, launch
configuration, the ``torch.autograd.Function``, the correctness rules, and PTX for real GPUs.
"""

from __future__ import annotations

import inspect
import math
import textwrap
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from fastdl_lab import checks, device, pyast
from fastdl_lab.attention.backward import (_attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel, _attn_bwd_preprocess_kernel,
                                           launch_backward, launch_backward_dkdv, launch_backward_dq)
from fastdl_lab.attention.forward import _attn_fwd_kernel, launch_forward
from fastdl_lab.attention.inputs import check_qkv, refuse_options, resolve_causal
from fastdl_lab.attention.reference import _scale, attention_ref, causal_mask, logsumexp_ref

KERNELS = {"fwd": _attn_fwd_kernel, "bwd_preprocess": _attn_bwd_preprocess_kernel,
           "bwd_dkdv": _attn_bwd_dkdv_kernel, "bwd_dq": _attn_bwd_dq_kernel}
# The names the lab's solution cells give their kernels, by launcher key (the grader reads these).
STUDENT_KERNELS = {"fwd": "attn_fwd_kernel", "bwd_preprocess": "attn_bwd_preprocess_kernel",
                   "bwd_dkdv": "attn_bwd_dkdv_kernel", "bwd_dq": "attn_bwd_dq_kernel"}
BWD_KEYS = ("bwd_preprocess", "bwd_dkdv", "bwd_dq")
# tl.dot needs every dimension to be a power of two of at least 16; past 128 the q tile and the
# accumulator no longer fit a GPU's registers next to the k and v tiles.
HEAD_DIMS = (16, 32, 64, 128)


def default_config(head_dim: int, dtype: torch.dtype, capability: int | None, block_m: int | None = None,
                   block_n: int | None = None) -> dict[str, int]:
    """Tile sizes and launch options on a GPU of compute ``capability`` (``device.capability``;
    None: the CPU interpreter); ``block_m`` / ``block_n`` force the query / key tile of every kernel.

    ``num_warps`` / ``num_stages`` launch the forward, ``bwd_num_warps`` / ``bwd_num_stages`` the
    two main backward kernels. ``compiled`` builds each kernel at exactly this configuration.
    """
    if capability is None:
        # The interpreter pays per program and per loop trip, not per element: large tiles.
        fwd = bwd = (64, 64)
        warps = bwd_warps = 4
        stages = bwd_stages = 1
    elif dtype == torch.float32:
        # Four bytes an element: halve the tiles so that the q, k and v tiles and their pipeline
        # copies stay within the shared memory of every course GPU.
        fwd, bwd = (64, 32), (32, 32)
        warps = bwd_warps = 4
        stages = bwd_stages = 2
    else:
        # 128 queries a program give each loaded k, v tile 128 rows of reuse; the backward holds two
        # accumulators (dk, dv or dq plus the tiles it recomputes), hence its smaller tiles.
        fwd, bwd = (128, 64), (64, 64)
        # Eight warps share the 128 query rows (two warpgroups of 64 rows on Hopper): with four, the
        # causal forward on a ragged length needs all 255 registers and spills on sm_80
        # (benchmarks/results/kernels_sm80.csv); with eight it takes about 170.
        warps = 8
        bwd_warps = 4
        # Hopper's 227 KiB of shared memory holds a third k, v buffer for the forward at no spill
        # (tests/test_attention_ptx.py checks head dims 64 and 128), so one more load is in flight while
        # a tile is computed. Ampere keeps the two stages it has: whether a third pays there takes
        # a GPU to time.
        stages = 3 if capability >= 90 else 2
        bwd_stages = 2
    fwd_m, fwd_n = block_m or fwd[0], block_n or fwd[1]
    bwd_m, bwd_n = block_m or bwd[0], block_n or bwd[1]
    return {"block_m": fwd_m, "block_n": fwd_n, "bwd_block_m": bwd_m, "bwd_block_n": bwd_n,
            "num_warps": warps, "num_stages": stages, "bwd_num_warps": bwd_warps, "bwd_num_stages": bwd_stages}


def _validate_options(scale, kernels, block_m, block_n) -> None:
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    if kernels is not None:
        if not isinstance(kernels, Mapping):
            raise TypeError(f"kernels must be a dict with keys {sorted(KERNELS)}, got {type(kernels).__name__}")
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown kernel name(s) {unknown}; the keys are {sorted(KERNELS)}")
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size is not None and (not isinstance(size, int) or size < 16 or size & (size - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (a tl.dot dimension), got {size!r}")


def _prepare(q, k, v, causal, scale, kernels, block_m=None, block_n=None):
    """Validate; returns (causal, scale as a float, every kernel by key, launch configuration)."""
    causal = resolve_causal(causal, None)
    check_qkv(q, k, v, head_dims=HEAD_DIMS, causal=causal)
    device.check_kernel_tensor(q, "q, k and v are")
    _validate_options(scale, kernels, block_m, block_n)
    d = q.shape[-1]
    config = default_config(d, q.dtype, device.capability(q), block_m, block_n)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return causal, sm_scale, {**KERNELS, **(kernels or {})}, config


class FlashAttentionFunction(torch.autograd.Function):
    """Autograd wiring: saves q, k, v, the output and the per-row logsumexp; nothing N x N.

    ``FlashAttentionFunction.apply(q, k, v, is_causal=False, scale=None)`` takes (batch, heads,
    tokens, head_dim) or (batch, tokens, head_dim) tensors; ``flash_attention`` is the same with
    tile sizes, replacement kernels and PyTorch's option names. ``is_causal`` and ``scale`` go by
    keyword only where torch's ``Function.apply`` takes keywords (2.13 does, 2.11 does not).
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, scale=None, kernels=None, config=None):
        if config is None:
            # Called directly rather than through flash_attention, which has validated already.
            is_causal, scale, kernels, config = _prepare(q, k, v, is_causal, scale, kernels)
        shape = q.shape
        n, d = shape[-2:]
        # The kernels share one (slice, row) stride pair for every tensor: contiguous rows of d.
        q3, k3, v3 = (t.reshape(math.prod(shape[:-2]), n, d).contiguous() for t in (q, k, v))
        ### BEGIN SOLUTION
        o, lse = launch_forward(kernels["fwd"], q3, k3, v3, is_causal, scale, config)
        out = o.view(shape)
        ctx.save_for_backward(q3, k3, v3, out, lse)
        ctx.causal, ctx.scale, ctx.kernels, ctx.config = is_causal, scale, kernels, config
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, do):
        ### BEGIN SOLUTION
        q3, k3, v3, out, lse = ctx.saved_tensors
        # A gradient from .sum() is an expanded scalar whose strides are all 0.
        do3 = do.contiguous().view(q3.shape)
        dq, dk, dv = launch_backward(ctx.kernels, q3, k3, v3, out.view(q3.shape), lse, do3, ctx.causal, ctx.scale,
                                     ctx.config)
        shape = out.shape
        return dq.view(shape), dk.view(shape), dv.view(shape), None, None, None, None
        ### END SOLUTION


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    dropout_p: float = 0.0,
                    *, causal: bool | None = None, is_causal: bool | None = None, scale: float | None = None,
                    kernels: Mapping | None = None, block_m: int | None = None, block_n: int | None = None,
                    function: type[torch.autograd.Function] | None = None) -> torch.Tensor:
    """softmax(scale q k^T) v with the Triton kernels, differentiable in q, k and v.

    Called as ``F.scaled_dot_product_attention`` is: q, k, v of shape (batch, heads, tokens,
    head_dim) or (batch, tokens, head_dim), one dtype and device, as many keys as queries,
    head_dim in ``HEAD_DIMS``, any number of tokens; ``is_causal`` (or ``causal``): query i attends
    keys 0..i; ``scale`` defaults to 1/sqrt(head_dim). What the kernels do not compute
    (``attn_mask``, ``dropout_p``, cross-attention, grouped heads, other head dims) raises
    ``UnsupportedAttentionError``. ``kernels`` may replace any of the package's kernels by key
    (``KERNELS``); each must take the arguments of the kernel it replaces. ``block_m`` / ``block_n``
    force the query / key tile of every kernel, so that short sequences still span several tiles.
    ``function`` replaces ``FlashAttentionFunction``: lab 05 has students wire their kernels into
    autograd themselves; it is applied to 4-D ``(q, k, v, causal, scale, kernels, config)``.
    """
    refuse_options(attn_mask, dropout_p)
    causal = resolve_causal(causal, is_causal)
    causal, sm_scale, chosen, config = _prepare(q, k, v, causal, scale, kernels, block_m, block_n)
    one_head = q.dim() == 3
    if one_head:
        q, k, v = (t.unsqueeze(1) for t in (q, k, v))
    out = (function or FlashAttentionFunction).apply(q, k, v, causal, sm_scale, chosen, config)
    return out.squeeze(1) if one_head else out


def backward_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, kernels: Mapping, *,
                   causal: bool = False, scale: float | None = None, block_m: int | None = None,
                   block_n: int | None = None) -> dict[str, torch.Tensor]:
    """Gradients from the backward kernels in ``kernels`` alone, each part judged on its own.

    The forward's o and logsumexp come from the references (``forward_ref``), so no forward kernel
    is involved. ``"bwd_preprocess"`` with ``"bwd_dkdv"`` give ``{"dk", "dv"}``; ``"bwd_dq"`` gives
    ``{"dq"}``, fed by delta = rowsum(dO * O) computed here in fp32, as the preprocess kernel would.
    4-D inputs.
    """
    causal, sm_scale, chosen, config = _prepare(q, k, v, causal, scale, kernels, block_m, block_n)
    if q.dim() != 4 or do.shape != q.shape:
        raise ValueError(f"backward_parts takes 4-D q, k, v and a do of q's shape, got {tuple(q.shape)} and "
                         f"{tuple(do.shape)}")
    b, h, n, d = q.shape
    o, lse = forward_ref(q, k, v, causal, sm_scale)
    lse = lse.float().reshape(b * h, n).contiguous()
    q3, k3, v3, o3, do3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v, o, do))
    parts = {}
    if "bwd_dkdv" in kernels:
        dk, dv, _ = launch_backward_dkdv(chosen, q3, k3, v3, o3, lse, do3, causal, sm_scale, config)
        parts.update(dk=dk.view(q.shape), dv=dv.view(q.shape))
    if "bwd_dq" in kernels:
        delta = (do3.float() * o3.float()).sum(-1)
        dq = launch_backward_dq(chosen["bwd_dq"], q3, k3, v3, do3, lse, delta, causal, sm_scale, config)
        parts["dq"] = dq.view(q.shape)
    return parts


def kernel_written(kernel) -> bool:
    """False while ``kernel``'s body still raises NotImplementedError (the release's stub), so that a
    notebook can skip an optional exercise left undone instead of stopping at it."""
    source = textwrap.dedent(inspect.getsource(getattr(kernel, "fn", kernel)))
    return not pyast.raises_not_implemented(pyast.parse(source))


def tf32_products(q: torch.Tensor) -> bool:
    """Whether ``tl.dot`` multiplies ``q``'s values on TF32 tensor cores: fp32 on a GPU. The
    interpreter's ``tl.dot`` is true fp32."""
    return q.dtype == torch.float32 and q.is_cuda


def _scores_tf32(q, k, causal, scale):
    scores = checks.tf32_matmul(q, k.transpose(-2, -1)) * _scale(q.shape[-1], scale)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return scores


def _probs_tf32(q, k, causal, scale):
    return torch.softmax(_scores_tf32(q, k, causal, scale), dim=-1)


def _attention_tf32(q, k, v, causal, scale):
    """``attention_ref`` with both products as TF32 tensor cores compute them."""
    return checks.tf32_matmul(_probs_tf32(q, k, causal, scale), v)


def forward_ref(q, k, v, causal: bool, scale: float | None):
    """(o, logsumexp) as a forward kernel on these inputs computes them, for a backward to start from.

    The backward rebuilds P = exp(s - lse) from its own scores, so the lse it is given must come
    from scores computed as its own are: with fp32 on a GPU, TF32 products. An exact lse against
    TF32 scores leaves every row of P off by the scores' rounding, which tensor cores make one-sided
    (they drop the low mantissa bits): on an H200 that tripled a correct kernel's dK error.
    """
    if tf32_products(q):
        scores = _scores_tf32(q, k, causal, scale)
        return checks.tf32_matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)
    return attention_ref(q, k, v, causal=causal, scale=scale), logsumexp_ref(q, k, causal=causal, scale=scale)


def _flash_grads_tf32(q, k, v, do, causal, scale):
    """dq, dk, dv by the FlashAttention backward's arithmetic with TF32 products.

    The backward takes delta = rowsum(dO * O) from the output rather than from dP: with TF32
    products the two differ by TF32 rounding, so where the exact gradient cancels to 0 (one key)
    every kernel built this way is left with that rounding, and so is this baseline.
    """
    tau = _scale(q.shape[-1], scale)
    p = _probs_tf32(q, k, causal, scale)
    o = checks.tf32_matmul(p, v)
    dv = checks.tf32_matmul(p.transpose(-2, -1), do)
    dp = checks.tf32_matmul(do, v.transpose(-2, -1))
    ds = p * (dp - (do * o).sum(-1, keepdim=True))
    return (checks.tf32_matmul(ds, k) * tau, checks.tf32_matmul(ds.transpose(-2, -1), q) * tau, dv)


def _torch_attention(q, k, v, causal, scale):
    """PyTorch's own attention in the precision a kernel on these inputs works in."""
    if q.dtype == torch.float32:
        # On a GPU tl.dot takes fp32 operands through TF32 tensor cores: the baseline is attention
        # with TF32 products. On the CPU the interpreter's tl.dot is true fp32, and so is the baseline.
        if tf32_products(q):
            return _attention_tf32(q, k, v, causal, scale)
        return attention_ref(q, k, v, causal=causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


# The gradients sum N terms per element, so fp32 rounding shows relative to the size of those
# terms rather than element by element: GRAD_RTOL times the gradient's largest magnitude or its
# a-priori bound, whichever is larger (see check_attention_grads).
GRAD_RTOL = 2e-5


def _fp32_accurate(actual, exact: torch.Tensor, dtype: torch.dtype, atol: float, rtol: float) -> bool:
    if type(actual) is not torch.Tensor or actual.dtype != dtype or actual.shape != exact.shape:
        return False
    a, e = actual.detach().cpu().double(), exact.cpu()
    return bool(((a - e).abs() <= atol + rtol * e.abs()).all())


def _judge(actual, exact: torch.Tensor, torch_result, dtype: torch.dtype, atol: float, rtol: float,
           name: str) -> None:
    """Accept fp32 accuracy outright; otherwise no worse than twice PyTorch's own error.

    Within fp32 tolerances of the exact result is acceptable in any precision (the low-precision
    rule alone would reject it where PyTorch happens to be exact: with one key, PyTorch's dq is
    exactly 0, a kernel's is rounding noise). Beyond them, large scores make attention
    ill-conditioned for every implementation, fp32 included: then PyTorch's own result in the
    same precision (``torch_result()``) sets the bar.
    """
    if not _fp32_accurate(actual, exact, dtype, atol, rtol):
        checks.assert_low_precision_close(actual, exact.float(), torch_result(), name=name)


def check_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None, name: str = "o") -> None:
    """Raise ``checks.MismatchError`` unless ``out`` is attention(q, k, v) to q's precision.

    Passes within fp32 tolerances of the fp64 reference; otherwise ``out`` must be no worse than
    twice PyTorch's own error in q's precision, both against fp64: ``F.scaled_dot_product_attention``
    for fp16 and bf16, ``attention_ref`` for fp32 (with emulated TF32 products on a GPU, where
    ``tl.dot`` uses TF32 tensor cores for fp32).
    """
    exact = attention_ref(q.double(), k.double(), v.double(), causal=causal, scale=scale)
    atol, rtol = checks.tolerance(torch.float32)
    _judge(out, exact, lambda: _torch_attention(q, k, v, causal, scale), q.dtype, atol, rtol, name)


def _attention_grads(fn, q, k, v, do):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, do)


def check_attention_grads(grads, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                          causal: bool = False, scale: float | None = None, name: str = "") -> None:
    """Check ``grads = (dq, dk, dv)`` of sum(do * attention(q, k, v)), as ``check_attention`` checks o.

    ``grads`` may instead map some of the names "dq", "dk", "dv" to gradients: only those are
    checked (``backward_parts`` returns such a dict).

    The fp32 tolerance of each gradient is widened by ``GRAD_RTOL`` times the larger of its
    largest magnitude and its a-priori bound: dS = P * (dP - delta) with delta a P-weighted mean
    of dP, so |dq| <= 2 scale max|dP| max|k| and |dk| <= 2 scale max|dP| max|q| times the column
    sums of P. The bound matters where the exact gradient is 0 by cancellation (with one key, dq
    and dk are dP - delta = 0, which a kernel computes as a difference of two rounded sums).
    PyTorch's own gradients are the autograd gradients of the attention ``check_attention`` uses;
    for fp32 on a GPU, the FlashAttention backward with TF32 products (``_flash_grads_tf32``).
    """
    exact = _attention_grads(lambda *t: attention_ref(*t, causal=causal, scale=scale),
                             q.double(), k.double(), v.double(), do.double())
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dp_max = _largest(torch.matmul(do.double(), v.double().transpose(-2, -1)))
    bounds = (tau * dp_max * _largest(k.double()), tau * dp_max * _largest(q.double()), 0.0)
    torch_grads = []

    def torch_grad(i):
        if not torch_grads:
            if tf32_products(q):
                torch_grads.extend(_flash_grads_tf32(q, k, v, do, causal, scale))
            else:
                torch_grads.extend(_attention_grads(lambda *t: _torch_attention(*t, causal, scale), q, k, v, do))
        return torch_grads[i]

    labels = ("dq", "dk", "dv")
    named = dict(grads) if isinstance(grads, Mapping) else dict(zip(labels, grads, strict=True))
    unknown = sorted(set(named) - set(labels))
    if unknown:
        raise ValueError(f"unknown gradient name(s) {unknown}; the names are {list(labels)}")
    atol, rtol = checks.tolerance(torch.float32)
    for i, label in enumerate(labels):
        if label in named:
            spread = max(_largest(exact[i]), bounds[i])
            _judge(named[label], exact[i], lambda: torch_grad(i), q.dtype, atol + GRAD_RTOL * spread, rtol,
                   f"{name} {label}".strip())


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


_PER_ROW = {"lse_ptr", "delta_ptr"}


def compiled(capability: int = 90, dtype: torch.dtype = torch.float16, *, which: str = "fwd", head_dim: int = 64,
             causal: bool = True, even_n: bool = True, kernel=None, block_m: int | None = None,
             block_n: int | None = None):
    """One kernel ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq") compiled for an NVIDIA GPU of
    compute ``capability``, no GPU needed: Triton's compiled kernel (PTX and cubin in ``.asm``).

    Built at exactly the configuration the launcher uses there, ``default_config(head_dim, dtype,
    capability)``, as a launch on a sequence length and strides that are multiples of 16 would
    be; ``even_n``: a length that is also a multiple of both tiles (such as the graded 2048), which
    drops every bounds mask. ``kernel`` replaces the package's kernel of that name (same arguments;
    the specialisation flags it does not declare are left out).
    """
    from fastdl_lab import triton_aot

    if which not in KERNELS:
        raise ValueError(f"which must be one of {sorted(KERNELS)}, got {which!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if not isinstance(capability, int) or isinstance(capability, bool):
        raise ValueError(f"capability must be an NVIDIA compute capability such as 80 or 90, got {capability!r}")
    if dtype not in device.TRITON_TYPES:
        raise ValueError(f"dtype must be one of {sorted(map(str, device.TRITON_TYPES))}, got {dtype!r}")
    config = default_config(head_dim, dtype, capability, block_m, block_n)
    if which == "fwd":
        bm, bn, warps, stages = config["block_m"], config["block_n"], config["num_warps"], config["num_stages"]
    else:
        bm, bn = config["bwd_block_m"], config["bwd_block_n"]
        warps, stages = config["bwd_num_warps"], config["bwd_num_stages"]
    chosen = kernel or KERNELS[which]
    names = triton_aot.arg_names(chosen)
    flags = {"CAUSAL": causal, "BLOCK_M": bm, "BLOCK_N": bn, "HEAD_DIM": head_dim, "EVEN_N": even_n}
    constexprs = {name: value for name, value in flags.items() if name in names}
    ty = device.TRITON_TYPES[dtype]
    signature = {name: ("*fp32" if name in _PER_ROW else f"*{ty}" if name.endswith("_ptr") else
                        "fp32" if name == "scale" else "i32")
                 for name in names if name not in constexprs}
    aligned = [name for name in signature if name.endswith("_ptr") or name.startswith("stride") or name == "N"]
    return triton_aot.compile_kernel(chosen, signature, constexprs, capability=capability, num_warps=warps,
                                     num_stages=stages, divisible_by_16=aligned)


def ptx(capability: int = 90, dtype: torch.dtype = torch.float16, **options) -> str:
    """PTX of ``compiled(capability, dtype, **options)``: the kernel the launcher runs on that GPU."""
    return compiled(capability, dtype, **options).asm["ptx"]
