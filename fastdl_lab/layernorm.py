"""LayerNorm as fused Triton kernels, forward and backward (lab 03 layernorm).

LayerNorm does a handful of FLOPs per element, so its speed is its memory traffic: the fused
kernels here read each input once and write each output once (plus re-reads that hit the cache).

- ``layer_norm_ref``: the reference, in fp32 (fp64 for fp64 inputs), two-pass statistics;
- ``naive_variance_layer_norm``: the one-pass ``E[x^2] - E[x]^2`` formula, which loses every
  significant digit on rows whose mean is large next to their spread (``catastrophic_input``);
- ``_layernorm_fwd_kernel``: one program per row; block statistics merged with Chan's parallel
  form of Welford's update, so rows longer than one block stay stable;
- ``_layernorm_bwd_dx_kernel``: dx per strip of rows, plus each strip's column sums for the
  weight and bias gradients as one partial row; ``_layernorm_bwd_dwdb_kernel`` adds the partial
  rows up (two stages, no atomics: deterministic);
- ``layer_norm``: the differentiable launcher (``LayerNormFunction``); ``kernels=`` takes the
  student's kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
import triton.language as tl


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dimension, computed in fp32 (fp64 for fp64 inputs), in x's dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc = x.to(compute)
    mean = xc.mean(-1, keepdim=True)
    # Two passes: the variance comes from deviations about the mean, never from E[x^2].
    var = (xc - mean).square().mean(-1, keepdim=True)
    y = (xc - mean) * torch.rsqrt(var + eps) * weight.to(compute) + bias.to(compute)
    return y.to(x.dtype)


def naive_variance_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                              eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm with var = E[x^2] - E[x]^2, every step rounded to x's precision: one pass, unstable."""
    mean = x.mean(-1, keepdim=True)
    var = (x * x).mean(-1, keepdim=True) - mean * mean
    return (x - mean) * torch.rsqrt(var + eps) * weight + bias


def catastrophic_input(rows: int, cols: int, *, mean: float = 1e3, std: float = 0.1,
                       dtype: torch.dtype = torch.float32, seed: int = 0,
                       device: str | torch.device = "cpu") -> torch.Tensor:
    """Rows with a mean far larger than their spread: the input the one-pass variance fails on.

    At the defaults E[x^2] is about 1e6, where fp32 values are 1/16 apart, while the variance is
    1e-2: the difference of the two squares is pure rounding noise (often negative, so NaN).
    """
    return checks.randn(rows, cols, dtype=dtype, seed=seed, device=device, scale=std, offset=mean)


# An fp32 mean is only known to a relative 2^-24, so no fp32 LayerNorm can promise x_hat closer than
# 2^-24 |mean| / std (6e-4 at catastrophic_input's defaults). The bound leaves room for the
# summation order of a kernel's block reductions; the naive formula misses it by orders of
# magnitude, or returns NaN.
STABLE_ATOL = 1e-2


def stability_error(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    eps: float = 1e-5) -> float:
    """Largest |y - LayerNorm(x)| against the fp64 reference; inf if y has a NaN or an Inf."""
    exact = layer_norm_ref(x.double(), weight.double(), bias.double(), eps)
    err = (y.detach().double() - exact).abs()
    return float(err.max()) if bool(err.isfinite().all()) else float("inf")


# Rounding a row's mean to fp32 alone moves x_hat by up to 2^-24 |mean| / std, and a kernel's sums
# and block merges add several such roundings: a kernel that merges 256 blocks of 16 was measured
# at about 6 of them. Rows whose mean dwarfs their spread get this many roundings of slack.
MEAN_ROUNDINGS = 16


def _x_hat_slack(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the fp32 error allowed in x_hat (see MEAN_ROUNDINGS), and 1/std, both in fp64."""
    rows = x.detach().double().reshape(-1, x.shape[-1])
    rstd = torch.rsqrt(rows.var(-1, unbiased=False) + eps)
    return MEAN_ROUNDINGS * 2.0**-24 * rows.mean(-1).abs() * rstd, rstd


def _largest(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def check_layer_norm(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float = 1e-5, name: str = "y") -> None:
    """Raise ``checks.MismatchError`` unless ``actual`` is LayerNorm(x) to x's precision.

    fp32 must match the fp64 reference to fp32 tolerances, widened for rows whose mean is large
    next to their standard deviation by what rounding that mean costs (``MEAN_ROUNDINGS``); fp16
    and bf16 follow the low-precision rule, against PyTorch's own ``F.layer_norm`` in that precision.
    """
    exact = layer_norm_ref(x.double(), weight.double(), bias.double(), eps)
    if x.dtype == torch.float32:
        slack, _ = _x_hat_slack(x, eps)
        atol = checks.tolerance(torch.float32)[0] + _largest(slack) * _largest(weight.detach().abs())
        checks.assert_close(actual, exact.float(), atol=atol, name=name)
    else:
        lowp = F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        checks.assert_low_precision_close(actual, exact.float(), lowp, name=name)


def check_layer_norm_grads(grads, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           dy: torch.Tensor, eps: float = 1e-5, name: str = "") -> None:
    """Check ``grads = (dx, dweight, dbias)`` of sum(dy * LayerNorm(x)), as ``check_layer_norm`` does y.

    In fp32 an error e in x_hat costs dx up to about rstd * |dy * weight| * e per row, and dweight
    the sum over rows of |dy| * e; dbias does not depend on x. dweight and dbias are also sums over
    every row, which a kernel adds in an order of its own (per-program partial sums, then their
    reduction): each may be off by a rounding unit times the sum of its terms' magnitudes.
    """
    def autograd(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        return torch.autograd.grad(fn(*leaves[:3], eps), leaves[:3], leaves[3])

    exact = autograd(layer_norm_ref, x.double(), weight.double(), bias.double(), dy.double())
    lowp = None if x.dtype == torch.float32 else autograd(
        lambda *a: F.layer_norm(a[0], a[0].shape[-1:], *a[1:]), x, weight, bias, dy)
    if lowp is None:
        slack, rstd = _x_hat_slack(x, eps)
        dy_rows = dy.detach().double().reshape(slack.shape[0], -1)
        g_rows = (dy_rows * weight.detach().double()).abs().amax(-1)
        x_hat = (x.detach().double().reshape(dy_rows.shape) - x.detach().double().reshape(dy_rows.shape)
                 .mean(-1, keepdim=True)) * rstd[:, None]
        unit = 2.0**-24
        extra = (_largest(slack * rstd * g_rows),
                 _largest((slack[:, None] * dy_rows.abs()).sum(0)) + unit * _largest((dy_rows * x_hat).abs().sum(0)),
                 unit * _largest(dy_rows.abs().sum(0)))
    for i, label in enumerate(("dx", "dweight", "dbias")):
        full = f"{name} {label}".strip()
        if lowp is None:
            atol = checks.tolerance(torch.float32)[0] + extra[i]
            checks.assert_close(grads[i], exact[i].float(), atol=atol, name=full)
        else:
            checks.assert_low_precision_close(grads[i], exact[i].float(), lowp[i], name=full)


@triton.jit
def _layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                          BLOCK_N: tl.constexpr):
    """One program normalises one row of N elements and records the row's mean and 1/std."""
    ### BEGIN SOLUTION
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK_N)

    # Running (count, mean, M2) of the columns seen so far, M2 being the sum of squared deviations
    # from the mean. Each block's own mean and M2 come from deviations about the block's mean,
    # and Chan's formula merges them: no sum of squares of large values is ever formed.
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        n_block = tl.minimum(N - start, BLOCK_N).to(tl.float32)
        mean_block = tl.sum(x, axis=0) / n_block
        # Padding loaded as 0 would otherwise count as a deviation of -mean_block.
        dev = tl.where(mask, x - mean_block, 0.0)
        m2_block = tl.sum(dev * dev, axis=0)
        total = count + n_block
        delta = mean_block - mean
        mean += delta * (n_block / total)
        m2 += m2_block + delta * delta * (count * n_block / total)
        count = total
    rstd = tl.rsqrt(m2 / N + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)

    # The second read of the row comes from cache on a GPU (a row is a few KiB).
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w + b
        tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


@triton.jit
def _layernorm_bwd_dx_kernel(x_ptr, dy_ptr, dx_ptr, w_ptr, mean_ptr, rstd_ptr, dw_partial_ptr, db_partial_ptr,
                             stride_xm, stride_dym, stride_dxm, stride_pm, M, N,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: dx for a strip of BLOCK_M rows, and the strip's column sums of dy * x_hat and dy
    stored as row ``program_id`` of the partial buffers."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    cols = tl.arange(0, BLOCK_N)
    mean = tl.load(mean_ptr + rows, mask=in_rows, other=0.0)
    rstd = tl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
    x_rows = x_ptr + rows[:, None] * stride_xm
    dy_rows = dy_ptr + rows[:, None] * stride_dym

    # First pass: the row means of g = dy * w and of g * x_hat, which every dx element needs.
    # Masked elements load dy = 0, hence g = 0: their meaningless x_hat never reaches a sum.
    sum_g = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sum_gx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        mask = in_rows[:, None] & (offs[None, :] < N)
        x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
        x_hat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        sum_g += tl.sum(g, axis=1)
        sum_gx += tl.sum(g * x_hat, axis=1)
    mean_g = sum_g / N
    mean_gx = sum_gx / N

    # Second pass: dx, and this strip's share of dweight and dbias, one partial row per program
    # so that no two programs ever write the same address.
    for start in range(0, N, BLOCK_N):
        offs = start + cols
        in_cols = offs < N
        mask = in_rows[:, None] & in_cols[None, :]
        x = tl.load(x_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=in_cols, other=0.0).to(tl.float32)
        x_hat = (x - mean[:, None]) * rstd[:, None]
        dx = (dy * w[None, :] - mean_g[:, None] - x_hat * mean_gx[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * stride_dxm + offs[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_partial_ptr + pid * stride_pm + offs, tl.sum(dy * x_hat, axis=0), mask=in_cols)
        tl.store(db_partial_ptr + pid * stride_pm + offs, tl.sum(dy, axis=0), mask=in_cols)
    ### END SOLUTION


@triton.jit
def _layernorm_bwd_dwdb_kernel(dw_partial_ptr, db_partial_ptr, dw_ptr, db_ptr, stride_pm, M, N,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program adds up BLOCK_N columns of the M partial rows into dweight and dbias."""
    ### BEGIN SOLUTION
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & in_cols[None, :]
        offs = rows[:, None] * stride_pm + cols[None, :]
        dw += tl.sum(tl.load(dw_partial_ptr + offs, mask=mask, other=0.0), axis=0)
        db += tl.sum(tl.load(db_partial_ptr + offs, mask=mask, other=0.0), axis=0)
    tl.store(dw_ptr + cols, dw.to(dw_ptr.dtype.element_ty), mask=in_cols)
    tl.store(db_ptr + cols, db.to(db_ptr.dtype.element_ty), mask=in_cols)
    ### END SOLUTION


KERNELS = {"fwd": _layernorm_fwd_kernel, "bwd_dx": _layernorm_bwd_dx_kernel, "bwd_dwdb": _layernorm_bwd_dwdb_kernel}


# SMs of the course's GPUs, for the backward strip height when no GPU is there to ask (AOT compiles).
SM_COUNTS = {80: 108, 90: 132}


def default_config(n_cols: int, n_rows: int, capability: int | None, block_n: int | None = None,
                   sm_count: int | None = None) -> dict[str, int]:
    """Block sizes, warps and stages of the three kernels for an ``n_rows x n_cols`` input on a GPU of
    ``capability`` (None: the CPU interpreter). ``block_n`` forces every column block; ``sm_count``
    (by default this GPU's, or a typical one for ``capability``) sets how tall backward strips may be."""
    width = triton.next_power_of_2(max(n_cols, 16))
    if capability is None:
        # The interpreter's cost is per program and per operation, not per element: whole rows
        # in one block and tall strips keep CPU runs short.
        block = block_n or min(width, 4096)
        return {"block_n": block, "bwd_block_n": block, "bwd_block_m": 8, "sum_block_m": 8, "sum_block_n": block,
                "num_warps": 4, "sum_num_warps": 4, "num_stages": 1}
    # Up to 8192 elements a row is a single block (16 KiB of fp16, a few registers per thread).
    block = block_n or min(width, 8192)
    # Backward tiles of about 4096 elements, as several rows where the rows are short: a tall
    # strip keeps the partial buffers (one fp32 row per strip) small next to x and dy, while
    # leaving a few programs for every SM.
    bwd_block_n = block_n or min(width, 1024)
    strip = max(1, min(16, 4096 // bwd_block_n))
    if sm_count is None:
        here = device.info().sm_count if device.capability() == capability else None
        sm_count = here or SM_COUNTS.get(capability, 100)
    while strip > 1 and triton.cdiv(n_rows, strip) < 2 * sm_count:
        strip //= 2
    # One stage: the loops stream each block once (or twice, from the cache), with no tl.dot whose
    # operands a software pipeline would prefetch into shared memory.
    return {"block_n": block, "bwd_block_n": bwd_block_n, "bwd_block_m": strip, "sum_block_m": 32,
            "sum_block_n": block_n or 64, "num_warps": 4 if block <= 2048 else 8, "sum_num_warps": 4,
            "num_stages": 1}


def _validate(x, weight, bias, kernels, block_n) -> None:
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension to normalise, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},): one value per element "
                             "of x's last dimension")
        if t.dtype != x.dtype:
            raise ValueError(f"x is {x.dtype} but {name} is {t.dtype}; cast one of them first")
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {t.device}")
    device.check_kernel_tensor(x, "x is")
    if kernels is not None:
        if not isinstance(kernels, Mapping):
            raise TypeError(f"kernels must be a dict with keys {sorted(KERNELS)}, got {type(kernels).__name__}")
        unknown = sorted(set(kernels) - set(KERNELS))
        if unknown:
            raise ValueError(f"unknown kernel name(s) {unknown}; the keys are {sorted(KERNELS)}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")


class LayerNormFunction(torch.autograd.Function):
    """Autograd wiring: the forward kernel saves (x, weight, mean, rstd), the backward kernels use them."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, kernels, config):
        n = x.shape[-1]
        # The kernels address rows by one stride and columns as contiguous.
        x2d = x.reshape(-1, n)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        weight, bias = weight.contiguous(), bias.contiguous()
        m = x2d.shape[0]
        y = checks.output_buffer((m, n), x.dtype, x)
        mean = checks.output_buffer((m,), torch.float32, x)
        rstd = checks.output_buffer((m,), torch.float32, x)
        if m:
            kernels["fwd"][(m,)](x2d, y, weight, bias, mean, rstd, x2d.stride(0), y.stride(0), n, eps,
                                 BLOCK_N=config["block_n"], num_warps=config["num_warps"],
                                 num_stages=config["num_stages"])
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.kernels, ctx.config, ctx.x_shape = kernels, config, x.shape
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        config, kernels = ctx.config, ctx.kernels
        m, n = x2d.shape
        # A gradient from .sum() is an expanded scalar whose strides are all 0.
        dy = dy.contiguous().reshape(m, n)
        dx = checks.output_buffer((m, n), x2d.dtype, x2d)
        dw = checks.output_buffer((n,), weight.dtype, x2d)
        db = checks.output_buffer((n,), weight.dtype, x2d)
        strips = triton.cdiv(m, config["bwd_block_m"])
        if strips == 0:
            return dx.reshape(ctx.x_shape), dw.zero_(), db.zero_(), None, None, None
        dw_partial = checks.output_buffer((strips, n), torch.float32, x2d)
        db_partial = checks.output_buffer((strips, n), torch.float32, x2d)
        kernels["bwd_dx"][(strips,)](
            x2d, dy, dx, weight, mean, rstd, dw_partial, db_partial,
            x2d.stride(0), dy.stride(0), dx.stride(0), dw_partial.stride(0), m, n,
            BLOCK_M=config["bwd_block_m"], BLOCK_N=config["bwd_block_n"], num_warps=config["num_warps"],
            num_stages=config["num_stages"])
        kernels["bwd_dwdb"][(triton.cdiv(n, config["sum_block_n"]),)](
            dw_partial, db_partial, dw, db, dw_partial.stride(0), strips, n,
            BLOCK_M=config["sum_block_m"], BLOCK_N=config["sum_block_n"], num_warps=config["sum_num_warps"],
            num_stages=config["num_stages"])
        return dx.reshape(ctx.x_shape), dw, db, None, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5, *,
               kernels: Mapping | None = None, block_n: int | None = None) -> torch.Tensor:
    """LayerNorm over x's last dimension with the Triton kernels; differentiable in x, weight, bias.

    ``kernels`` may replace any of the package's kernels by name ("fwd", "bwd_dx", "bwd_dwdb");
    each must take the same arguments as the kernel it replaces. ``block_n`` forces the column
    block (a power of two >= 16) of every kernel, so that rows span several blocks. x may have any
    leading shape; weight and bias are 1-D, of x's dtype.
    """
    _validate(x, weight, bias, kernels, block_n)
    config = default_config(x.shape[-1], x.numel() // x.shape[-1], device.capability(x), block_n)
    chosen = {**KERNELS, **(kernels or {})}
    return LayerNormFunction.apply(x, weight, bias, float(eps), chosen, config)


_ROW_DATA = {"x_ptr", "y_ptr", "w_ptr", "b_ptr", "dy_ptr", "dx_ptr", "dw_ptr", "db_ptr"}


# The launcher's (BLOCK_M, BLOCK_N, warps) keys of ``default_config`` for each kernel.
_CONFIG_KEYS = {"fwd": (None, "block_n", "num_warps"), "bwd_dx": ("bwd_block_m", "bwd_block_n", "num_warps"),
                "bwd_dwdb": ("sum_block_m", "sum_block_n", "sum_num_warps")}


def compiled(capability: int = 90, dtype: torch.dtype = torch.float16, n_cols: int = 1024, n_rows: int = 4096, *,
             which: str = "fwd", block_n: int | None = None, kernel=None):
    """Triton's compiled kernel ``which`` ("fwd", "bwd_dx", "bwd_dwdb") for an NVIDIA GPU of
    ``capability``, no GPU needed, at the blocks, warps and stages ``default_config`` gives an
    ``n_rows x n_cols`` input there: what ``layer_norm`` launches.

    ``kernel`` replaces the package's kernel of that name (same arguments). Compiled as a launch
    on contiguous rows whose length and strides are multiples of 16 would be, so that Triton can
    prove the row loads aligned and vectorise them.
    """
    from fastdl_lab import triton_aot

    if which not in KERNELS:
        raise ValueError(f"which must be one of {sorted(KERNELS)}, got {which!r}")
    config = default_config(n_cols, n_rows, capability, block_n)
    block_m_key, block_n_key, warps_key = _CONFIG_KEYS[which]
    ty = device.TRITON_TYPES[dtype]
    code = KERNELS[which].fn.__code__
    # Row data in the tensors' own type; statistics and partial sums are always fp32.
    signature = {name: (f"*{ty}" if name in _ROW_DATA else "*fp32" if name.endswith("_ptr") else
                        "fp32" if name == "eps" else "i32")
                 for name in code.co_varnames[: code.co_argcount] if not name.startswith("BLOCK_")}
    constexprs = {"BLOCK_N": config[block_n_key]}
    if block_m_key:
        constexprs["BLOCK_M"] = config[block_m_key]
    aligned = [name for name in signature if name.endswith("_ptr") or name.startswith("stride") or name == "N"]
    return triton_aot.compile_kernel(kernel or KERNELS[which], signature, constexprs, capability=capability,
                                     num_warps=config[warps_key], num_stages=config["num_stages"],
                                     divisible_by_16=aligned)


def ptx(capability: int = 90, dtype: torch.dtype = torch.float16, n_cols: int = 1024, n_rows: int = 4096, *,
        which: str = "fwd", block_n: int | None = None, kernel=None) -> str:
    """PTX of ``compiled(...)``."""
    return compiled(capability, dtype, n_cols, n_rows, which=which, block_n=block_n, kernel=kernel).asm["ptx"]


def layer_norm_bytes(m: int, n: int, itemsize: int, backward: bool = False) -> int:
    """Minimum DRAM traffic of LayerNorm on an m x n input: the figure GB/s are computed from.

    Forward: read x, write y (weight, bias and the per-row mean and rstd are small change).
    Backward: read x and dy, write dx, plus weight in and the two parameter gradients out.
    """
    forward = 2 * m * n * itemsize + 2 * n * itemsize + 8 * m
    return forward + (3 * m * n * itemsize + 3 * n * itemsize + 8 * m if backward else 0)


# Benchmark spec: what benchmarks/layernorm.py runs. GB/s are layer_norm_bytes over the median
# time. On the CPU the Triton rows time the interpreter on a small case (a figure about Python,
# recorded so that nobody mistakes it for the kernel's); the torch rows are real CPU figures.
BENCHMARK = {
    "name": "layernorm",
    "cpu": {"interpreter": [(64, 512)], "torch": [(4096, 1024)], "torch_unfused": [(4096, 1024)],
            "torch_compile": [(4096, 1024)]},
    "gpu": dict.fromkeys(["triton", "torch"], [(4096, n) for n in (512, 1024, 2048, 4096, 8192, 16384)]),
    "dtypes": {"cpu": [torch.float32], "gpu": [torch.float16, torch.float32]},
    "passes": ["fwd", "fwd+bwd"],
    "gpu_only": ["triton"],
}


def _variant_fn(variant: str, x, w, b, dy, backward: bool) -> Callable:
    def fused(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b)

    fn = torch.compile(fused) if variant == "torch_compile" else {
        "triton": layer_norm, "interpreter": layer_norm, "torch": fused, "torch_unfused": layer_norm_ref}[variant]
    if not backward:
        return lambda: fn(x, w, b)
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Time every variant of the spec this machine can run, both passes; one dict per measurement."""
    from fastdl_lab import timing

    on_gpu = device.has_gpu()
    where, dev = ("gpu", "cuda") if on_gpu else ("cpu", "cpu")
    if not on_gpu:
        log("triton: needs a GPU (the interpreter rows time Python, not the kernel)")
    rows, torch_timings = [], {}
    for dtype in BENCHMARK["dtypes"][where]:
        for variant, shapes in BENCHMARK[where].items():
            for (m, n), passes in ((shape, p) for shape in shapes for p in BENCHMARK["passes"]):
                backward = passes == "fwd+bwd"
                x = checks.randn(m, n, dtype=dtype, seed=1, device=dev)
                w = checks.randn(n, dtype=dtype, seed=2, device=dev, scale=0.1, offset=1.0)
                b = checks.randn(n, dtype=dtype, seed=3, device=dev, scale=0.1)
                dy = checks.randn(m, n, dtype=dtype, seed=4, device=dev)
                fn = _variant_fn(variant, x, w, b, dy, backward)
                key = (dtype, m, n, passes)
                if key not in torch_timings:
                    torch_timings[key] = timing.bench(_variant_fn("torch", x, w, b, dy, backward), reps=reps)
                ci = (None, None)
                if variant == "torch":
                    t, speedup = torch_timings[key], 1.0
                elif variant in BENCHMARK["gpu_only"]:
                    # Two kernels on one GPU stream: interleave them, as graded comparisons do.
                    cmp = timing.compare(fn, _variant_fn("torch", x, w, b, dy, backward), reps=reps)
                    t, speedup, ci = cmp.candidate, cmp.speedup, (cmp.ci_low, cmp.ci_high)
                else:
                    slow = variant == "interpreter"
                    t = timing.bench(fn, warmup=1 if slow else 3, reps=3 if slow else reps)
                    speedup = torch_timings[key].median / t.median
                moved = layer_norm_bytes(m, n, dtype.itemsize, backward)
                row = {"op": "layernorm", "variant": variant, "pass": passes, "m": m, "n": n,
                       "dtype": str(dtype).replace("torch.", ""), "median_s": t.median, "iqr_s": t.iqr,
                       "gbs": moved / t.median / 1e9, "speedup_vs_torch": speedup,
                       "ci_low": ci[0], "ci_high": ci[1]}
                rows.append(row)
                log(f"{variant:>14} {passes:>7} {m}x{n} {row['dtype']:>8}: {t.median * 1e3:10.3f} ms "
                    f"{row['gbs']:8.2f} GB/s  {speedup:.3g}x F.layer_norm")
    return rows


def check() -> None:
    """Forward and gradients on ragged shapes, and the stability demonstration; raises on a mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for shape, block_n in [((1, 1), None), ((37, 300), None), ((5, 3, 300), 64)]:
            n = shape[-1]
            x = checks.randn(shape, dtype=dtype, seed=1, device=dev).requires_grad_()
            w = checks.randn(n, dtype=dtype, seed=2, device=dev, scale=0.5, offset=1.0).requires_grad_()
            b = checks.randn(n, dtype=dtype, seed=3, device=dev, scale=0.5).requires_grad_()
            dy = checks.randn(shape, dtype=dtype, seed=4, device=dev)
            y = layer_norm(x, w, b, block_n=block_n)
            check_layer_norm(y, x.detach(), w.detach(), b.detach(), name=f"y {dtype} {shape}")
            grads = torch.autograd.grad(y, (x, w, b), dy)
            check_layer_norm_grads(grads, x.detach(), w.detach(), b.detach(), dy, name=f"{dtype} {shape}")
    x = catastrophic_input(16, 300, device=dev)
    w, b = torch.ones(300, device=dev), torch.zeros(300, device=dev)
    stable, naive = (stability_error(f(x, w, b), x, w, b) for f in (layer_norm, naive_variance_layer_norm))
    assert stable < STABLE_ATOL < naive, (stable, naive)
    print(f"layernorm: checks passed (catastrophic input: kernel error {stable:.1e}, naive {naive:.1e})")


if __name__ == "__main__":
    check()
    benchmark()
