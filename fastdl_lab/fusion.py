"""Compute, bandwidth, overhead, and what fusion does about each (lab 02 fusion).

Experiments that show which of the three limits an operation is under:

- ``overhead_probe``: time per op of a Python float add, and of a PyTorch add from one element to
  millions: flat (overhead) until the tensor is large enough, then proportional to its size;
- ``repeated_multiply``: ``x * 1.0001`` chained ``k`` times. Eagerly every multiply is a trip
  through memory; ``repeated_multiply_compiled`` fuses the chain into one pass (torch.compile), so
  its time stays flat while memory is the limit and rises once the arithmetic is;
- ``pointwise_chain``: eight pointwise ops, the everyday case torch.compile fuses.

Fusions that are exact rewrites of a network:

- ``fold_conv_bn_ref``: at inference a BatchNorm after a convolution is an affine map per
  channel, so it folds into the convolution's weights and bias; ``fold_model`` does every pair;
- ``conv_bn_train``: Conv -> BatchNorm in training with ``ConvBNFunction``, which keeps only the
  convolution's input for backward and recomputes the convolution's output there, instead of
  keeping both (``conv_bn_train_ref``). ``saved_tensor_bytes`` measures the difference.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks, device
# Lab 02 measures ConvBN with these; they live in the shared memory module.
from fastdl_lab.memory import peak_memory_bytes, saved_tensor_bytes  # noqa: F401

FACTOR = 1.0001


# ---------------------------------------------------------------------------------------------
# Overhead


def overhead_probe(n_ops: int = 2000, sizes=(1, 16, 256, 4096, 1 << 16, 1 << 20, 1 << 22)) -> list[dict]:
    """Seconds per op: a Python float add, then ``a + b`` on PyTorch tensors of each size.

    Each timed call runs up to ``n_ops`` ops in a loop (fewer for large tensors), so neither the
    timer nor a synchronize hides the per-op cost. On a GPU the clock is the host's, with one
    synchronize per call: launch overhead is what this measures.
    """
    from fastdl_lab import timing

    def python_adds():
        s = 0.0
        for _ in range(n_ops):
            s = s + 1.0
        return s

    rows = [{"what": "python float add", "elements": 1,
             "per_op_s": timing.bench(python_adds, warmup=2, reps=10).median / n_ops}]
    dev = "cuda" if device.has_gpu() else "cpu"
    for size in sizes:
        a = torch.ones(size, device=dev)
        b = torch.ones(size, device=dev)
        ops = max(1, min(n_ops, (1 << 20) // size))

        def torch_adds():
            for _ in range(ops):
                a + b

        per_op = timing.bench(torch_adds, warmup=2, reps=10, sync=True).median / ops
        rows.append({"what": "torch add", "elements": size, "per_op_s": per_op})
    return rows


# ---------------------------------------------------------------------------------------------
# Bandwidth or compute: the repeated multiply


def repeated_multiply(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * FACTOR`` applied ``k`` times, eagerly: ``k`` reads and ``k`` writes of the tensor."""
    for _ in range(k):
        x = x * FACTOR
    return x


@functools.cache
def repeated_multiply_compiled(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The same chain compiled by torch.compile into one kernel: one read, one write, ``k`` FLOPs."""
    # One FX graph per k rather than a compiled Python loop: dynamo caches its work per code
    # object, recompiles for every value of a loop count, and after 8 of them (recompile_limit)
    # logs a warning and runs that code eagerly from then on.
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    for _ in range(k):
        x = graph.call_function(operator.mul, (x, FACTOR))
    graph.output(x)
    return torch.compile(torch.fx.GraphModule(nn.Module(), graph))


def repeated_multiply_curve(ks, n: int | None = None, *, dtype: torch.dtype = torch.float32, reps: int = 10,
                            eager_max_k: int = 64) -> list[dict]:
    """Time both versions for each ``k``; one dict per k with achieved GB/s and FLOP/s.

    GB/s and FLOP/s are the compiled version's: it moves the tensor once in and once out and does
    ``k`` multiplies per element. ``eager_gbs`` counts the eager version's ``k`` round trips. The
    eager version is only timed up to ``eager_max_k`` (None beyond): its cost is ``k`` passes.
    """
    from fastdl_lab import timing

    gpu = device.has_gpu()
    n = n or (1 << 26 if gpu else 1 << 22)
    x = checks.randn(n, dtype=dtype, device="cuda" if gpu else "cpu")
    moved = 2 * n * dtype.itemsize
    rows = []
    for k in ks:
        compiled = repeated_multiply_compiled(k)
        t = timing.bench(lambda: compiled(x), warmup=2, reps=reps)
        eager = timing.bench(lambda: repeated_multiply(x, k), warmup=1, reps=reps) if k <= eager_max_k else None
        rows.append({"k": k, "n": n, "eager_s": eager.median if eager else None, "compiled_s": t.median,
                     "gbs": moved / t.median / 1e9, "flop_per_s": k * n / t.median,
                     "eager_gbs": k * moved / eager.median / 1e9 if eager else None})
    return rows


def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    """Eight pointwise ops: eagerly eight passes over memory, compiled one."""
    y = x * 0.5
    y = y + 1.0
    y = y * x
    y = torch.relu(y)
    y = y - 0.25
    y = y * y
    y = torch.sigmoid(y)
    return y + x


# ---------------------------------------------------------------------------------------------
# Conv + BatchNorm folding (inference)


def fold_conv_bn_ref(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new convolution (with bias) equal to ``bn(conv(x))`` with ``bn`` in eval mode.

    In eval mode BatchNorm computes ``(y - mean) / sqrt(var + eps) * gamma + beta`` per channel
    with its running statistics: a scale ``s = gamma / sqrt(var + eps)`` and a shift. Scaling
    output channel ``c`` of the convolution's weight by ``s[c]`` and setting the bias to
    ``(b - mean) * s + beta`` gives the same map in one op.
    """
    ### BEGIN SOLUTION
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError("BatchNorm without running statistics normalises by the batch: it cannot be folded")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"BatchNorm has {bn.num_features} channels, the convolution {conv.out_channels}")
    with torch.no_grad():
        # fp64 for the new parameters: the folded layer then differs from the pair only by the
        # rounding of its own convolution.
        scale = torch.rsqrt(bn.running_var.double() + bn.eps)
        shift = -bn.running_mean.double()
        if conv.bias is not None:
            shift = shift + conv.bias.double()
        if bn.affine:
            scale = scale * bn.weight.double()
        bias = shift * scale
        if bn.affine:
            bias = bias + bn.bias.double()
        fused = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                          padding=conv.padding, dilation=conv.dilation, groups=conv.groups, bias=True,
                          padding_mode=conv.padding_mode, device=conv.weight.device, dtype=conv.weight.dtype)
        fused.weight.copy_(conv.weight.double() * scale.reshape(-1, 1, 1, 1))
        fused.bias.copy_(bias)
    return fused.eval()
    ### END SOLUTION


def fold_model(model: nn.Module, fold: Callable[[nn.Conv2d, nn.BatchNorm2d], nn.Conv2d] | None = None) -> nn.Module:
    """An eval-mode copy of ``model`` with every Conv2d -> BatchNorm2d pair folded into one conv.

    ``fold`` is the folding function (default ``fold_conv_bn_ref``); see ``fold_adjacent``.
    """
    return fold_adjacent(model, nn.Conv2d, nn.BatchNorm2d, fold or fold_conv_bn_ref)


def fold_adjacent(model: nn.Module, first_type: type, second_type: type,
                  fold: Callable[[nn.Module, nn.Module], nn.Module]) -> nn.Module:
    """An eval-mode copy of ``model`` in which ``fold(a, b)`` replaces every ``a`` of ``first_type``
    directly followed by a ``b`` of ``second_type``, and ``b`` becomes ``nn.Identity``.

    Only pairs that follow each other inside an ``nn.Sequential`` are folded: there the order of
    the children is the order they run in.
    """
    folded = copy.deepcopy(model).eval()
    for module in folded.modules():
        if not isinstance(module, nn.Sequential):
            continue
        names = list(module._modules)
        for first, second in zip(names, names[1:]):
            a, b = module._modules[first], module._modules[second]
            if isinstance(a, first_type) and isinstance(b, second_type):
                module._modules[first] = fold(a, b)
                module._modules[second] = nn.Identity()
    return folded


def small_cnn(seed: int = 0, channels=(16, 32, 64), num_classes: int = 10) -> nn.Sequential:
    """A small image classifier with a BatchNorm after every conv, in eval mode, for 3-channel input.

    BatchNorm statistics and affine parameters are drawn at random (seeded), as if trained:
    freshly built ones (mean 0, variance 1, gamma 1, beta 0) would make folding look trivial.
    The first conv has no bias (the usual choice before a BatchNorm), the others have one.
    """
    gen = checks.generator(seed)
    layers, width = [], 3
    for i, out in enumerate(channels):
        layers += [nn.Conv2d(width, out, 3, stride=1 if i == 0 else 2, padding=1, bias=i > 0),
                   nn.BatchNorm2d(out), nn.ReLU()]
        width = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.weight[0].numel() ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
            elif isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(c, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(c, generator=gen))
                m.weight.copy_(0.5 + torch.rand(c, generator=gen))
                m.bias.copy_(0.1 * torch.randn(c, generator=gen))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Conv + BatchNorm in training, recomputing the convolution in backward


def conv_bn_train_ref(x, conv_weight, bn_weight, bn_bias, eps=1e-5, stride=1, padding=1):
    """Conv (no bias: BatchNorm's mean subtraction cancels it) then BatchNorm with batch statistics.

    Autograd keeps the convolution's input for its backward and the convolution's output for
    BatchNorm's.
    """
    y = F.conv2d(x, conv_weight, None, stride, padding)
    return F.batch_norm(y, None, None, bn_weight, bn_bias, training=True, eps=eps)


class ConvBNFunction(torch.autograd.Function):
    """Conv -> BatchNorm (training) that keeps x, the weights and two numbers per channel.

    Backward recomputes the convolution's output from x: one extra convolution buys back the
    largest tensor the pair would otherwise hold until backward.
    """

    @staticmethod
    def forward(ctx, x, conv_weight, bn_weight, bn_bias, eps, stride, padding):
        ### BEGIN SOLUTION
        y = F.conv2d(x, conv_weight, None, stride, padding)
        dims = (0, 2, 3)
        mean = y.mean(dim=dims)
        # Normalisation uses the biased variance, as BatchNorm does in training.
        invstd = torch.rsqrt(y.var(dim=dims, unbiased=False) + eps)
        out = (y - mean[:, None, None]) * (invstd * bn_weight)[:, None, None] + bn_bias[:, None, None]
        ctx.save_for_backward(x, conv_weight, bn_weight, mean, invstd)
        ctx.conv_args = (stride, padding)
        return out
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        ### BEGIN SOLUTION
        x, conv_weight, bn_weight, mean, invstd = ctx.saved_tensors
        stride, padding = ctx.conv_args
        y = F.conv2d(x, conv_weight, None, stride, padding)
        dims = (0, 2, 3)
        count = y.numel() // y.shape[1]
        x_hat = (y - mean[:, None, None]) * invstd[:, None, None]
        grad_bias = grad_out.sum(dim=dims)
        grad_weight = (grad_out * x_hat).sum(dim=dims)
        # BatchNorm's input gradient: the output gradient minus its mean and minus its
        # projection on x_hat (both per channel), scaled by gamma / std.
        grad_y = (grad_out - (grad_bias[:, None, None] + x_hat * grad_weight[:, None, None]) / count) \
            * (bn_weight * invstd)[:, None, None]
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.nn.grad.conv2d_input(x.shape, conv_weight, grad_y, stride, padding) if need_x else None
        grad_w = torch.nn.grad.conv2d_weight(x, conv_weight.shape, grad_y, stride, padding) if need_w else None
        return grad_x, grad_w, grad_weight, grad_bias, None, None, None
        ### END SOLUTION


def conv_bn_train(x, conv_weight, bn_weight, bn_bias, eps=1e-5, stride=1, padding=1):
    """Same outputs and gradients as ``conv_bn_train_ref``, with the conv output recomputed in backward."""
    return ConvBNFunction.apply(x, conv_weight, bn_weight, bn_bias, eps, stride, padding)


def convbn_operands(batch=8, in_channels=16, out_channels=32, size=32, *, dtype=torch.float32, seed=0,
                    dev: str = "cpu") -> tuple[torch.Tensor, ...]:
    """(x, conv_weight, bn_weight, bn_bias) requiring grad: the lab's ConvBN case by default."""
    x = checks.randn(batch, in_channels, size, size, dtype=dtype, seed=seed, device=dev)
    w = checks.randn(out_channels, in_channels, 3, 3, dtype=dtype, seed=seed + 1, device=dev,
                     scale=(9 * in_channels) ** -0.5)
    gamma = checks.randn(out_channels, dtype=dtype, seed=seed + 2, device=dev, scale=0.2, offset=1.0)
    beta = checks.randn(out_channels, dtype=dtype, seed=seed + 3, device=dev, scale=0.1)
    return tuple(t.requires_grad_() for t in (x, w, gamma, beta))


# ---------------------------------------------------------------------------------------------
# Benchmark spec: what benchmarks/fusion.py runs. Sizes keep the CPU run under two minutes, and
# CPU tensors at 16 MiB: glibc serves larger allocations with fresh pages from the kernel on every
# call, and every eager op's page faults would be timed. The repeated multiply reaches further on
# a GPU, whose compute roof is further from its memory roof.

BENCHMARK = {
    "name": "fusion",
    "cpu": {"chain_n": 1 << 22, "multiply_n": 1 << 22, "ks": [1, 2, 4, 8, 16, 32, 64, 128, 256],
            "eager_max_k": 64, "cnn_batch": 64},
    "gpu": {"chain_n": 1 << 26, "multiply_n": 1 << 26, "ks": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
            "eager_max_k": 256, "cnn_batch": 256},
}
# "speedup" is against the experiment's baseline: eager for compiled code, the unfolded model.
_COLUMNS = ("experiment", "variant", "size", "k", "dtype", "median_s", "iqr_s", "gbs", "gflops", "speedup",
            "bytes", "max_abs_diff")


def _row(**values) -> dict:
    return {c: values.get(c) for c in _COLUMNS}


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Every experiment of the lab on this machine; one dict per measurement, same columns."""
    from fastdl_lab import timing

    gpu = device.has_gpu()
    spec = BENCHMARK["gpu" if gpu else "cpu"]
    dev = "cuda" if gpu else "cpu"
    rows = [_row(experiment="overhead", variant=r["what"], size=r["elements"], dtype="float32",
                 median_s=r["per_op_s"]) for r in overhead_probe()]

    n = spec["chain_n"]
    x = checks.randn(n, device=dev)
    compiled = torch.compile(pointwise_chain)
    cmp = timing.compare(lambda: compiled(x), lambda: pointwise_chain(x), reps=reps)
    for variant, t in (("compiled", cmp.candidate), ("eager", cmp.baseline)):
        # Minimum traffic: x read once, the result written once.
        rows.append(_row(experiment="pointwise_chain", variant=variant, size=n, dtype="float32",
                         median_s=t.median, iqr_s=t.iqr, gbs=2 * n * 4 / t.median / 1e9,
                         speedup=cmp.baseline.median / t.median))

    for r in repeated_multiply_curve(spec["ks"], spec["multiply_n"], reps=reps, eager_max_k=spec["eager_max_k"]):
        eager = r["eager_s"]
        rows.append(_row(experiment="repeated_multiply", variant="compiled", size=r["n"], k=r["k"], dtype="float32",
                         median_s=r["compiled_s"], gbs=r["gbs"], gflops=r["flop_per_s"] / 1e9,
                         speedup=eager / r["compiled_s"] if eager else None))
        if eager is not None:
            rows.append(_row(experiment="repeated_multiply", variant="eager", size=r["n"], k=r["k"],
                             dtype="float32", median_s=eager, gbs=r["eager_gbs"],
                             gflops=r["k"] * r["n"] / eager / 1e9, speedup=1.0))

    model = small_cnn().to(dev)
    folded = fold_model(model)
    images = checks.randn(spec["cnn_batch"], 3, 32, 32, seed=1, device=dev)
    with torch.inference_mode():
        diff = float((folded(images) - model(images)).abs().max())
        cmp = timing.compare(lambda: folded(images), lambda: model(images), reps=reps)
    for variant, t in (("folded", cmp.candidate), ("conv_bn", cmp.baseline)):
        rows.append(_row(experiment="conv_bn_fold", variant=variant, size=spec["cnn_batch"], dtype="float32",
                         median_s=t.median, iqr_s=t.iqr, speedup=cmp.baseline.median / t.median, max_abs_diff=diff))

    operands = convbn_operands(dev=dev)
    for variant, fn in (("conv_bn_ref", conv_bn_train_ref), ("recompute", conv_bn_train)):
        rows.append(_row(experiment="convbn_saved_bytes", variant=variant, size="8x16x32x32->32", dtype="float32",
                         bytes=saved_tensor_bytes(fn, *operands)))
        peak = peak_memory_bytes(fn, *operands)
        if peak is not None:
            rows.append(_row(experiment="convbn_peak_bytes", variant=variant, size="8x16x32x32->32",
                             dtype="float32", bytes=peak))

    for r in rows:
        figures = [f"{r[c]:.4g} {c}" for c in ("median_s", "gbs", "gflops", "speedup", "bytes", "max_abs_diff")
                   if isinstance(r[c], (int, float))]
        k = f" k={r['k']}" if r["k"] is not None else ""
        log(f"{r['experiment']:>18} {r['variant']:>16} size={r['size']}{k}: " + ", ".join(figures))
    if not gpu:
        log("convbn_peak_bytes: needs a GPU (the CPU allocator keeps no peak statistics)")
    return rows


def check() -> None:
    """Folding, the recomputing ConvBN and the saved-bytes figure; raises on the first mismatch."""
    model = small_cnn()
    images = checks.randn(4, 3, 32, 32, seed=1)
    with torch.no_grad():
        checks.assert_close(fold_model(model)(images), model(images), atol=1e-4, rtol=1e-4, name="folded model")
    operands = convbn_operands()
    # A random upstream gradient: with sum(out ** 2) the input gradients of a BatchNorm vanish
    # exactly and only rounding noise would be compared.
    upstream = checks.randn(8, 32, 32, 32, seed=5)
    grads = []
    for fn in (conv_bn_train_ref, conv_bn_train):
        out = fn(*operands)
        grads.append((out, *torch.autograd.grad(out, operands, upstream)))
    for name, got, want in zip(("out", "x", "conv_weight", "bn_weight", "bn_bias"), grads[1], grads[0]):
        checks.assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"conv_bn_train {name}")
    ratio = saved_tensor_bytes(conv_bn_train, *operands) / saved_tensor_bytes(conv_bn_train_ref, *operands)
    assert ratio <= 0.6, ratio
    x = checks.randn(100)
    checks.assert_close(repeated_multiply(x, 3), x * FACTOR * FACTOR * FACTOR, name="repeated_multiply")
    print(f"fusion: checks passed (ConvBN with recompute keeps {ratio:.0%} of the bytes Conv -> BN keeps)")


if __name__ == "__main__":
    check()
    benchmark()
