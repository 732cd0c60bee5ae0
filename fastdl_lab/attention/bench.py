"""Benchmark spec and self-check of lab 05 attention; ``benchmarks/attention.py`` runs them.

On a GPU: TFLOP/s of the Triton kernels, of naive attention and of
``F.scaled_dot_product_attention`` across sequence lengths, forward and forward + backward. On
the CPU, where the interpreter's speed says nothing about a kernel's: the deterministic figure,
bytes autograd saves for the backward, naive against flash (the kernels, and FlashAttention in
plain PyTorch), across sequence lengths; naive
attention against PyTorch's fused CPU kernel (real CPU timings); and the interpreter's time on one
small case, recorded so that nobody mistakes it for the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastdl_lab import checks, device
from fastdl_lab.attention.function import check_attention, check_attention_grads, flash_attention
from fastdl_lab.attention.reference import attention_flops, attention_naive, attention_ref
from fastdl_lab.attention.torch_flash import flash_attention_torch

BENCHMARK = {
    "name": "attention",
    # saved_bytes: (batch, heads, head_dim) and the sequence lengths; the timed cases are
    # (batch, heads, tokens, head_dim).
    "cpu": {"saved_bytes": {"shape": (1, 1, 64), "ns": [128, 256, 512, 1024, 2048]},
            "interpreter": [(1, 2, 128, 64)], "torch": [(1, 4, n, 64) for n in (256, 1024, 2048)]},
    # batch * tokens stays at 16k, as in the FlashAttention papers' benchmarks, so every length
    # does about the same work per token. Naive attention keeps several batch x heads x N x N
    # tensors alive in the backward, 8 GiB each at N = 16384: it stops at 8192.
    "gpu": {"tokens": 16384, "heads": 16, "head_dims": [64, 128], "ns": [512, 1024, 2048, 4096, 8192, 16384],
            "naive_max_n": 8192},
    "dtypes": {"cpu": [torch.float32], "gpu": [torch.float16]},
    "passes": ["fwd", "fwd+bwd"],
    "causal": [False, True],
    "gpu_only": ["flash"],
}

_VARIANTS = {"flash": lambda q, k, v, causal: flash_attention(q, k, v, causal=causal),
             "naive": lambda q, k, v, causal: attention_naive(q, k, v, causal=causal),
             "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}


def _row(variant, passes, causal, shape, dtype, *, timing=None, flops=None, saved=None, speedup=None) -> dict:
    b, h, n, d = shape
    return {"op": "attention", "variant": variant, "pass": passes, "causal": causal, "batch": b, "heads": h,
            "n": n, "head_dim": d, "dtype": str(dtype).replace("torch.", ""),
            "median_s": timing.median if timing else None, "iqr_s": timing.iqr if timing else None,
            "tflops": flops / timing.median / 1e12 if timing and flops else None,
            "saved_bytes": saved, "speedup_vs_sdpa": speedup}


def _inputs(shape, dtype, dev, requires_grad=False):
    q, k, v = (checks.randn(shape, dtype=dtype, seed=s, device=dev).requires_grad_(requires_grad) for s in range(3))
    return q, k, v, checks.randn(shape, dtype=dtype, seed=3, device=dev)


def _call(variant: str, q, k, v, do, causal: bool, backward: bool) -> Callable:
    fn = _VARIANTS[variant]
    if not backward:
        return lambda: fn(q, k, v, causal)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return lambda: torch.autograd.grad(fn(*leaves, causal), leaves, do)


def _cpu_rows(reps: int, log) -> list[dict]:
    from fastdl_lab import memory, timing

    rows = []
    b, h, d = BENCHMARK["cpu"]["saved_bytes"]["shape"]
    for dtype in BENCHMARK["dtypes"]["cpu"]:
        for n in BENCHMARK["cpu"]["saved_bytes"]["ns"]:
            q, k, v, _ = _inputs((b, h, n, d), dtype, "cpu", requires_grad=True)
            for variant, fn in (("naive", attention_ref), ("flash", flash_attention),
                                ("flash_torch", flash_attention_torch)):
                saved = memory.saved_tensor_bytes(fn, q, k, v)
                rows.append(_row(variant, "fwd", False, (b, h, n, d), dtype, saved=saved))
                log(f"{variant:>6} saved for backward, N={n:>5}: {saved / 2**20:9.3f} MiB")
        for shape in BENCHMARK["cpu"]["torch"]:
            q, k, v, do = _inputs(shape, dtype, "cpu")
            for passes in BENCHMARK["passes"]:
                rows.extend(_timed_rows(shape, dtype, False, passes, q, k, v, do, ["naive"], reps, log))
        for shape in BENCHMARK["cpu"]["interpreter"]:
            q, k, v, do = _inputs(shape, dtype, "cpu")
            for passes in BENCHMARK["passes"]:
                backward = passes == "fwd+bwd"
                t = timing.bench(_call("flash", q, k, v, do, False, backward), warmup=1, reps=min(reps, 3))
                flops = attention_flops(shape[2], shape[3], batch_heads=shape[0] * shape[1], backward=backward)
                rows.append(_row("interpreter", passes, False, shape, dtype, timing=t, flops=flops))
                log(f"interpreter {passes:>7} {shape}: {t.median * 1e3:9.1f} ms (Python, not the kernel)")
    return rows


def _timed_rows(shape, dtype, causal, passes, q, k, v, do, variants, reps, log) -> list[dict]:
    """Each variant interleaved with the library kernel, as graded comparisons are; then the library's row."""
    from fastdl_lab import timing

    b, h, n, d = shape
    backward = passes == "fwd+bwd"
    flops = attention_flops(n, d, batch_heads=b * h, causal=causal, backward=backward)
    sdpa = _call("sdpa", q, k, v, do, causal, backward)
    rows, baseline = [], None
    for variant in variants:
        cmp = timing.compare(_call(variant, q, k, v, do, causal, backward), sdpa, reps=reps)
        baseline = baseline or cmp.baseline
        rows.append(_row(variant, passes, causal, shape, dtype, timing=cmp.candidate, flops=flops,
                         speedup=cmp.speedup))
    # The library's row is its half of the first comparison: same process, same conditions.
    rows.insert(0, _row("sdpa", passes, causal, shape, dtype, timing=baseline, flops=flops, speedup=1.0))
    log(", ".join(f"{r['variant']} {r['median_s'] * 1e3:.3g} ms ({r['tflops']:.3g} TFLOP/s)" for r in rows) +
        f": {passes} {shape} {rows[0]['dtype']} causal={causal}")
    return rows


def _gpu_rows(reps: int, log) -> list[dict]:
    spec, rows = BENCHMARK["gpu"], []
    for dtype in BENCHMARK["dtypes"]["gpu"]:
        for d in spec["head_dims"]:
            for causal in BENCHMARK["causal"]:
                for n in spec["ns"]:
                    shape = (max(1, spec["tokens"] // n), spec["heads"], n, d)
                    q, k, v, do = _inputs(shape, dtype, "cuda")
                    variants = ["flash"] + (["naive"] if n <= spec["naive_max_n"] else [])
                    for passes in BENCHMARK["passes"]:
                        rows.extend(_timed_rows(shape, dtype, causal, passes, q, k, v, do, variants, reps, log))
    return rows


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Every row of the spec this machine can give; one dict per measurement."""
    if device.has_gpu():
        return _gpu_rows(reps, log)
    log(f"{', '.join(BENCHMARK['gpu_only'])} TFLOP/s: needs a GPU (the interpreter rows time Python, not the kernel)")
    return _cpu_rows(reps, log)


def check() -> None:
    """Forward and gradients on ragged lengths, causal and not; raises on a mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for shape, block in [((1, 1, 1, 32), None), ((1, 2, 37, 64), 32), ((2, 1, 100, 32), None)]:
            for causal in (False, True):
                q, k, v, do = _inputs(shape, dtype, dev, requires_grad=True)
                for name, fn in (("flash", flash_attention), ("flash_torch", flash_attention_torch)):
                    if name == "flash":
                        o = fn(q, k, v, causal=causal, block_m=block, block_n=block)
                    else:
                        o = fn(q, k, v, causal=causal, block_n=block or 64)
                    label = f"{name} {shape} {dtype} causal={causal}"
                    check_attention(o, q.detach(), k.detach(), v.detach(), causal, name=f"o {label}")
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal, name=label)
    print("attention: checks passed")
