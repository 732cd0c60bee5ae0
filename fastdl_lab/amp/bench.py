"""Benchmark spec and self-check of lab 04 amp; ``benchmarks/amp.py`` runs them.

The benchmark times whole training steps (forward, backward, AdamW) of a small pre-norm
transformer block stack: fp32 against bf16 autocast on the CPU; on a GPU also TF32 matmuls and
fp16 autocast with a ``GradScaler``. Each variant is timed A/B interleaved against fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastdl_lab import checks, device
from fastdl_lab.amp.formats import FORMATS, gradient_underflow, long_sum_experiment, lost_update_experiment, round_to
from fastdl_lab.amp.memory import RECIPES, bytes_per_param_ref
from fastdl_lab.amp.scaler import DynamicLossScaler, scripted_run
from fastdl_lab.amp.training import train_step_amp, train_step_fp32, underflow_experiment

BENCHMARK = {
    "name": "amp",
    "cpu": {"batch": 16, "seq": 128, "d_model": 256, "heads": 4, "layers": 2,
            "variants": ["fp32", "bf16_autocast"]},
    "gpu": {"batch": 32, "seq": 512, "d_model": 1024, "heads": 16, "layers": 4,
            "variants": ["fp32", "tf32", "fp16_gradscaler", "bf16_autocast"]},
    "gpu_only": ["tf32", "fp16_gradscaler"],
    "columns": ["op", "variant", "batch", "seq", "d_model", "layers", "median_s", "iqr_s", "steps_per_s",
                "samples_per_s", "speedup_vs_fp32", "ci_low", "ci_high"],
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP, each residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def tiny_transformer(d_model: int, heads: int, layers: int, seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(*(Block(d_model, heads) for _ in range(layers)))


@contextlib.contextmanager
def _tf32(enabled: bool):
    """TF32 for matmuls and convolutions inside the block only; a notebook's setting is restored."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _step_fn(variant: str, spec: dict, dev: str) -> Callable[[], float]:
    model = tiny_transformer(spec["d_model"], spec["heads"], spec["layers"]).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shape = (spec["batch"], spec["seq"], spec["d_model"])
    x, y = checks.randn(shape, seed=1, device=dev), checks.randn(shape, seed=2, device=dev)
    if variant in ("fp32", "tf32"):
        def step():
            with _tf32(variant == "tf32"):
                return train_step_fp32(model, optimizer, x, y, F.mse_loss)
        return step
    dtype, scaled = {"fp16_gradscaler": (torch.float16, True), "bf16_autocast": (torch.bfloat16, False)}[variant]
    # bf16 has fp32's range: its scaler is a disabled one, which passes everything through.
    scaler = torch.amp.GradScaler(dev, enabled=scaled)
    return lambda: train_step_amp(model, optimizer, scaler, x, y, F.mse_loss, dtype=dtype)


def _row(**values) -> dict:
    return {column: values.get(column) for column in BENCHMARK["columns"]}


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Time a training step of every variant this machine can run; one dict per variant."""
    from fastdl_lab import timing

    gpu = device.has_gpu()
    spec, dev = (BENCHMARK["gpu"], "cuda") if gpu else (BENCHMARK["cpu"], "cpu")
    if not gpu:
        log(f"{' and '.join(BENCHMARK['gpu_only'])} (and the GPU-sized model): needs a GPU")
    shape = {k: spec[k] for k in ("batch", "seq", "d_model", "layers")}
    baseline = _step_fn("fp32", spec, dev)
    measured = {}
    for variant in (v for v in spec["variants"] if v != "fp32"):
        cmp = timing.compare(_step_fn(variant, spec, dev), baseline, reps=reps)
        measured[variant] = cmp.candidate, cmp.speedup, (cmp.ci_low, cmp.ci_high)
        # The fp32 row is the baseline of the first comparison: timed in the same rounds as a variant.
        measured.setdefault("fp32", (cmp.baseline, 1.0, (None, None)))
    rows = []
    for variant in spec["variants"]:
        t, speedup, ci = measured[variant]
        rows.append(_row(op="train_step", variant=variant, **shape, median_s=t.median, iqr_s=t.iqr,
                         steps_per_s=1 / t.median, samples_per_s=spec["batch"] / t.median,
                         speedup_vs_fp32=speedup, ci_low=ci[0], ci_high=ci[1]))
        log(f"train step {variant:>16} batch {spec['batch']}x{spec['seq']} d={spec['d_model']} x{spec['layers']}: "
            f"{t.median * 1e3:8.2f} ms, {1 / t.median:7.2f} steps/s, {spec['batch'] / t.median:8.1f} samples/s, "
            f"{speedup:.2f}x fp32")
    return rows


def check() -> None:
    """The formats, the scaler against torch's, the calculator and the underflow experiment."""
    for name, fmt in FORMATS.items():
        assert float(round_to(fmt.max, name)) == fmt.max, name
    assert float(round_to(65520.0, "fp16")) == float("inf")
    assert lost_update_experiment(steps=10)["final"]["bf16"] == 1.0
    sums = long_sum_experiment()
    assert sums["exact"] > 20 * sums["fp16"], sums["fp16"]
    assert gradient_underflow()["zero"]["bf16"] == 0.0

    inject = {1: "inf", 2: "nan", 5: "inf", 9: "nan"}
    for max_norm in (None, 1.0):
        ours = scripted_run(DynamicLossScaler("cpu", init_scale=2.0**10, growth_interval=3), inject=inject,
                            max_norm=max_norm)
        theirs = scripted_run(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3), inject=inject,
                              max_norm=max_norm)
        assert ours["scale"] == theirs["scale"] and ours["skipped"] == theirs["skipped"], (ours, theirs)
        for mine, torchs in zip(ours["params"], theirs["params"]):
            assert torch.equal(mine, torchs)

    totals = {name: bytes_per_param_ref(recipe)["total"] for name, recipe in RECIPES.items()}
    assert totals["fp32_adam"] == totals["mixed_fp16_master_adam"] == 16.0 and totals["pure_bf16_adam"] == 8.0

    plain = underflow_experiment()
    scaled = underflow_experiment(scaler=DynamicLossScaler("cpu"))
    assert min(plain["zero_fraction"]) >= 0.9 and plain["loss"][-1] > 0.95 * plain["loss"][0]
    assert scaled["loss"][-1] < 0.5 * scaled["loss"][0]
    print(f"amp: checks passed (fp16 without scaling: {min(plain['zero_fraction']):.0%} of gradients zero; "
          f"with a dynamic scaler the loss falls to {scaled['loss'][-1] / scaled['loss'][0]:.0%})")


if __name__ == "__main__":
    check()
    benchmark()
