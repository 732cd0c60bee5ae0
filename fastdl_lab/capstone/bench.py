"""Benchmark of the capstone's training step (lab 10): one row per figure, with its machine.

- ``peak``: the FLOP rate of one large square matmul (fp32 on a CPU, bf16 on a GPU), the MFU's
  denominator, measured as lab 00 does;
- ``step``: a full training step (zero_grad, forward, backward, AdamW) of the package's model on
  torch's parts and on the course's (lab 03's LayerNorm, lab 05's FlashAttention: the Triton
  kernels on a GPU, their plain-PyTorch versions on a CPU): seconds, tokens/s and MFU;
- ``memory``: the step's four parts measured, beside the formula's prediction;
- ``checkpointing``, ``precision``, ``compile``: lab 10's three experiments.

The CPU size is ``CPU_CONFIG`` at batch 8 in fp32; on a GPU the step runs ``GPU_CONFIG`` (GPT-2
medium's shape) at batch 8 under bf16 autocast, and the experiments a GPT-2 small width.
``benchmarks/capstone.py`` appends the rows to ``benchmarks/results/capstone.csv``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdl_lab import checks, device, timing
from fastdl_lab.capstone import accounting, experiments, model as capstone_model, step

BENCHMARK = {
    "name": "capstone",
    "cpu": {"step": (capstone_model.CPU_CONFIG, 8), "experiments": (capstone_model.CPU_CONFIG, 8),
            "memory": (capstone_model.CPU_CONFIG, 8), "peak_n": 1024,
            "precision_steps": 100, "compile_steps": 6, "reps": 10},
    "gpu": {"step": (capstone_model.GPU_CONFIG, 8),
            "experiments": (capstone_model.GPTConfig(vocab_size=50304, seq_len=1024, d_model=768, n_head=12,
                                                     n_layer=12), 8),
            "memory": (capstone_model.CPU_CONFIG, 8), "peak_n": 8192, "precision_steps": 100, "compile_steps": 6,
            "reps": 20},
    "quick": {"step": (capstone_model.GPTConfig(seq_len=16, d_model=32, n_head=2, n_layer=1), 2),
              "experiments": (capstone_model.GPTConfig(seq_len=16, d_model=32, n_head=2, n_layer=1), 2),
              "memory": (capstone_model.GPTConfig(seq_len=16, d_model=32, n_head=2, n_layer=1), 2), "peak_n": 64, "precision_steps": 3, "compile_steps": 2, "reps": 2},
    "columns": ["experiment", "variant", "case", "median_s", "tokens_per_s", "mfu", "figure", "unit", "note"],
}
Log = Callable[[str], None]


def row(**values) -> dict:
    unknown = set(values) - set(BENCHMARK["columns"])
    if unknown:
        raise KeyError(f"not a column of the capstone benchmark: {sorted(unknown)}")
    return {name: values.get(name) for name in BENCHMARK["columns"]}


def _case(config: capstone_model.GPTConfig, batch: int, dtype: str) -> str:
    return (f"d={config.d_model} T={config.seq_len} L={config.n_layer} heads={config.n_head} V={config.vocab_size}, "
            f"batch {batch}, {dtype}")


def measured_peak(n: int, dev: str, reps: int) -> float:
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    a, b = (checks.randn(n, n, dtype=dtype, device=dev, seed=s) for s in (0, 1))
    return 2 * n**3 / timing.bench(lambda: a @ b, warmup=2, reps=reps).median


def step_rows(spec: dict, dev: str) -> list[dict]:
    config, batch = spec["step"]
    peak = measured_peak(spec["peak_n"], dev, spec["reps"])
    dtype = "bf16 autocast" if dev == "cuda" else "fp32"
    rows = [row(experiment="peak", variant=f"{spec['peak_n']}^2 matmul", figure=peak / 1e9, unit="GFLOP/s",
                note="bf16" if dev == "cuda" else "fp32")]
    course = "course-triton" if dev == "cuda" else "course-pytorch"
    for parts in ("torch", course):
        gpt = capstone_model.build(config, layernorm=parts, attention=parts, device=dev)
        gpt.autocast_dtype = torch.bfloat16 if dev == "cuda" else None
        t = step.step_throughput(gpt, step.make_optimizer(gpt), batch, reps=spec["reps"], peak_flops=peak)
        rows.append(row(experiment="step", variant=f"{parts} parts", case=_case(config, batch, dtype),
                        median_s=t["seconds"], tokens_per_s=t["tokens_per_s"], mfu=t["mfu"],
                        figure=t["flops"] / 1e9, unit="GFLOP per step (matmuls)"))
        del gpt
    return rows


def memory_rows(spec: dict, dev: str) -> list[dict]:
    # Counted by storage on the CPU (``accounting.measure``): the same bytes on any machine for the
    # same sizes in fp32, so a GPU host records the CPU size too.
    config, batch = spec["memory"]
    measured = accounting.measure(config, batch)
    predicted = accounting.predict_memory_ref(config, batch)
    return [row(experiment="memory", variant=part, case=_case(config, batch, "fp32"), figure=measured[part],
                unit="bytes", note=f"predicted {predicted[part]}") for part in accounting.PARTS]


def experiment_rows(spec: dict, dev: str) -> list[dict]:
    config, batch = spec["experiments"]
    rows = []
    for r in experiments.checkpointing_sweep(config, batch, reps=spec["reps"]):
        rows.append(row(experiment="checkpointing", variant=f"{r['recompute_blocks']} blocks recomputed",
                        case=_case(config, batch, "fp32"), median_s=r["seconds"], figure=r["activation_bytes"],
                        unit="saved activation bytes"))
    for name, r in experiments.precision_runs(config, batch, spec["precision_steps"], reps=spec["reps"]).items():
        rows.append(row(experiment="precision", variant=name, case=_case(config, batch, name), median_s=r["seconds"],
                        figure=r["losses"][-1], unit=f"training loss at step {len(r['losses'])}",
                        note=f"{r['activation_bytes']} saved activation bytes"))
    compiled = experiments.compile_runs(config, batch, steps=spec["compile_steps"])
    for name, r in compiled.items():
        breaks = r.get("breaks")
        rows.append(row(experiment="compile", variant=name, case=_case(config, batch, "fp32"), median_s=r["later_s"],
                        figure=r["first_s"], unit="seconds of the first step",
                        note=None if name == "eager" else f"{r['graphs']} graphs, breaks: {breaks or 'none'}"))
    return rows


EXPERIMENTS = (step_rows, memory_rows, experiment_rows)


def benchmark(log: Log = print, size: str | None = None) -> list[dict]:
    dev = "cuda" if device.has_gpu() else "cpu"
    spec = BENCHMARK[size or ("gpu" if dev == "cuda" else "cpu")]
    rows = []
    for experiment in EXPERIMENTS:
        for r in experiment(spec, dev):
            rows.append(r)
            log(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if v is not None))
    return rows


def check() -> None:
    """Every row is whole at the quick size."""
    rows = benchmark(log=lambda _: None, size="quick")
    assert all(r["figure"] is not None for r in rows), rows
    print(f"capstone: {len(rows)} rows at the quick size")


if __name__ == "__main__":
    check()
