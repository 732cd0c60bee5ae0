"""Benchmark of the labs' ungraded experiments: each figure a section shows, recorded with its machine.

The sections that teach by measuring (lab 01's im2col, K alignment and first kernel; lab 02's
compiled overhead-bound loop and its FLOPs against time; lab 04's memory pools and compiled
optimizer step; lab 06's host-to-device copies and latency ladder; lab 09's distilled student,
depthwise-separable convolution and sparse products) print their figures at the student's desk.
This module measures the same experiments at the labs' full sizes and returns one row per figure,
so that ``benchmarks/experiments.py`` keeps them in ``benchmarks/results/experiments.csv`` beside
the machine that produced them. Every timed pair is A/B-interleaved by ``timing.compare`` (the
baseline is what a user would call instead); rows an experiment can only have on a GPU are kept
with the note "needs a GPU" and no figure, never a guess.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from fastdl_lab import checks, device, timing

BENCHMARK = {
    "name": "experiments",
    # Full sizes, as the labs run them with FASTDL_QUICK=0; ``quick`` is for the unit test only.
    "full": {"conv": (32, 32, 28, 28, 64), "k_m": 512, "gpu_k_m": 8192, "pool_mb": [1, 16, 64],
             "tiny_layers": (32, 64, 8), "optim_steps": 6, "copy_bytes": 256 << 20, "matmul_n": 4096,
             "distill_seed": 0, "separable": (128, 56), "breakdown": (None, 8),
             "sparse": (1024, (0.001, 0.01, 0.05, 0.1, 0.3)), "reps": 15},
    "quick": {"conv": (2, 4, 8, 8, 8), "k_m": 32, "gpu_k_m": 1024, "pool_mb": [1], "tiny_layers": (4, 16, 2),
              "optim_steps": 3, "copy_bytes": 1 << 20, "matmul_n": 256, "distill_seed": 0, "separable": (8, 12),
              "breakdown": ((64, 32, 2, 2), 2), "sparse": (64, (0.01, 0.5)), "reps": 3},
    "columns": ["lab", "experiment", "variant", "baseline", "case", "median_s", "iqr_s", "speedup", "ci_low",
                "ci_high", "figure", "unit", "note"],
}

NEEDS_GPU = "needs a GPU"
Log = Callable[[str], None]


def row(**values) -> dict:
    """One result row with every column of ``BENCHMARK["columns"]``; an unknown name is an error."""
    unknown = set(values) - set(BENCHMARK["columns"])
    if unknown:
        raise KeyError(f"not a column of the experiments benchmark: {sorted(unknown)}")
    return {name: values.get(name) for name in BENCHMARK["columns"]}


def _compared(lab: str, experiment: str, variant: str, baseline: str, case: str, cmp: timing.Comparison,
              **extra) -> dict:
    return row(lab=lab, experiment=experiment, variant=variant, baseline=baseline, case=case,
               median_s=cmp.candidate.median, iqr_s=cmp.candidate.iqr, speedup=cmp.speedup, ci_low=cmp.ci_low,
               ci_high=cmp.ci_high, **extra)


def _gpu_only(lab: str, experiment: str, variant: str, why: str) -> dict:
    return row(lab=lab, experiment=experiment, variant=variant, note=f"{NEEDS_GPU}: {why}")


# --- lab 01 ---------------------------------------------------------------------------------------

def im2col_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import im2col

    n, c, h, w, o = spec["conv"]
    x = checks.randn(n, c, h, w, device=dev, seed=4)
    weight = checks.randn(o, c, 3, 3, device=dev, seed=5)
    checks.assert_close(im2col.conv2d_im2col(x, weight, padding=1), F.conv2d(x, weight, padding=1),
                        atol=1e-4, rtol=1e-4, name="im2col conv")
    cmp = timing.compare(lambda: im2col.conv2d_im2col(x, weight, padding=1), lambda: F.conv2d(x, weight, padding=1),
                         reps=spec["reps"])
    return [_compared("01", "conv as a matmul", "im2col + matmul", "F.conv2d",
                      f"{(n, c, h, w)} * {o} 3x3, padding 1", cmp,
                      figure=im2col.im2col_expansion(h, w, 3, padding=1), unit="unrolled elements per input element")]


def k_alignment_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import shapes

    rows = []
    m = spec["k_m"]
    a_odd, b_odd = shapes.k_alignment_operands(4095, m, m, dev=dev)
    a_even, b_even = shapes.k_alignment_operands(4096, m, m, dev=dev)
    cmp = timing.compare(lambda: a_odd @ b_odd, lambda: a_even @ b_even, reps=spec["reps"])
    rows.append(_compared("01", "K alignment", "K=4095 fp32", "K=4096 fp32", f"{m}x{m} outputs", cmp))
    if dev != "cuda":
        rows.append(_gpu_only("01", "K alignment", "K=4095 fp16", "the cliff is in the tensor cores' 16-byte loads"))
        return rows
    gm = spec["gpu_k_m"]
    a64, b64 = shapes.k_alignment_operands(4096, gm, gm, torch.float16, "cuda")
    for k in (4095, 4088):  # 4088: aligned to 8 elements, one step short of 4096
        a, b = shapes.k_alignment_operands(k, gm, gm, torch.float16, "cuda")
        cmp = timing.compare(lambda a=a, b=b: a @ b, lambda: a64 @ b64, reps=spec["reps"])
        rows.append(_compared("01", "K alignment", f"K={k} fp16", "K=4096 fp16", f"{gm}x{gm} outputs", cmp))
    return rows


def scaled_add_rows(spec: dict, dev: str) -> list[dict]:
    if dev != "cuda":
        return [_gpu_only("01", "first kernel", "scaled_add", "the interpreter times Python, not the kernel")]
    from fastdl_lab import scaled_add

    n = 1 << 26
    x, y = checks.randn(n, device="cuda", seed=0), checks.randn(n, device="cuda", seed=1)
    cmp = timing.compare(lambda: scaled_add.scaled_add(x, y, 2.0), lambda: torch.add(y, x, alpha=2.0),
                         reps=spec["reps"])
    return [_compared("01", "first kernel", "scaled_add", "torch.add(y, x, alpha)", f"{n} fp32", cmp,
                      figure=3 * 4 * n / cmp.candidate.median / 1e9, unit="GB/s")]


# --- lab 02 ---------------------------------------------------------------------------------------

def overhead_rows(spec: dict, dev: str) -> list[dict]:
    if dev != "cuda":
        return [_gpu_only("02", "overhead-bound loop", 'compile(mode="reduce-overhead")',
                          "CUDA graphs replay recorded kernels")]
    from fastdl_lab import compiler

    depth, width, batch = spec["tiny_layers"]
    times = compiler.reduce_overhead_timings(depth, width, batch, reps=spec["reps"])
    eager = times["eager"].median
    return [row(lab="02", experiment="overhead-bound loop", variant=name, baseline="eager",
                case=f"{depth} layers {width} wide, batch {batch}", median_s=t.median, iqr_s=t.iqr,
                speedup=eager / t.median) for name, t in times.items() if name != "eager"]


def breakdown_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab.capstone import breakdown, data, model

    sizes, batch_size = spec["breakdown"]
    config = (model.CPU_CONFIG if sizes is None else
              model.GPTConfig(d_model=sizes[0], seq_len=sizes[1], n_layer=sizes[2], n_head=sizes[3]))
    gpt = model.build(config, attention="math", device=dev)
    x, y = next(data.batches("train", 1, batch_size, config.seq_len, device=dev))
    case = (f"GPT d={config.d_model} T={config.seq_len} L={config.n_layer}, batch {batch_size}, forward + backward, "
            "attention written out")
    return [row(lab="02", experiment="FLOPs against time", variant=r["class"], case=case, median_s=r["time_s"],
                figure=r["flops_share"], unit="share of FLOPs", note=f"{r['time_share']:.4f} of the time")
            for r in breakdown.flop_time_table(breakdown.training_step(gpt, x, y), steps=spec["reps"] // 3 or 1)]


# --- lab 04 ---------------------------------------------------------------------------------------

def pool_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import memory

    rows = []
    for mb in spec["pool_mb"]:
        # Reused is the candidate here: its speedup is how much the pool (or out=) saves.
        cmp = memory.fresh_vs_reused(mb, reps=spec["reps"])
        cmp = timing.Comparison.from_timings(cmp.baseline, cmp.candidate)
        rows.append(_compared("04", "memory pool (CPU malloc)", "torch.add(out=buffer)", "torch.add (fresh output)",
                              f"{mb} MB fp32, one thread", cmp))
    steps = memory.caching_allocator_steps()
    if steps is None:
        rows.append(_gpu_only("04", "caching allocator", "cudaMalloc calls over 5 steps", "the allocator is CUDA's"))
    else:
        rows.append(row(lab="04", experiment="caching allocator", variant="cudaMalloc calls over 5 steps",
                        case="64 MB temporary beside a persistent tensor", figure=steps[-1]["driver_mallocs"],
                        unit="calls"))
    return rows


def compiled_step_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import optim

    rows = []
    for as_tensor in (False, True):
        result = optim.compiled_step_graphs(lr_as_tensor=as_tensor, steps=spec["optim_steps"])
        later = sorted(result["seconds"][1:])
        rows.append(row(lab="04", experiment="compiled optimizer step",
                        variant=f"AdamW, LinearLR, lr as {'a 0-d tensor' if as_tensor else 'a float'}",
                        case=f"{spec['optim_steps']} steps, graphs counted, not code-generated",
                        median_s=later[len(later) // 2], figure=result["graphs"], unit="graphs",
                        note=f"first step {result['seconds'][0]:.3f} s (tracing), slowest later step "
                             f"{later[-1]:.3f} s (a recompile, where one happens)"))
    return rows


# --- lab 06 ---------------------------------------------------------------------------------------

def transfer_rows(spec: dict, dev: str) -> list[dict]:
    if dev != "cuda":
        return [_gpu_only("06", "host-to-device copy", variant, "there is no copy to a device without one")
                for variant in ("pageable copy", "pinned copy (non_blocking)")]
    from fastdl_lab.data import transfer

    result = transfer.copy_vs_matmul(spec["copy_bytes"], spec["matmul_n"], reps=spec["reps"])
    rows = []
    for name, t in result["timings"].items():
        copy = "copy" in name
        figure = result["bytes"] / t.median / 1e9 if copy else 2 * spec["matmul_n"] ** 3 / t.median / 1e12
        rows.append(row(lab="06", experiment="host-to-device copy", variant=name, median_s=t.median, iqr_s=t.iqr,
                        case=f"{result['bytes']} B" if copy else "fp16", figure=figure,
                        unit="GB/s" if copy else "TFLOP/s"))
    return rows


def ladder_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab.data import transfer

    return [row(lab="06", experiment="latency ladder", variant=r["what"], median_s=r["seconds"],
                note=None if r["seconds"] is not None else f"{NEEDS_GPU}: a GPU rung")
            for r in transfer.latency_ladder(reps=spec["reps"])]


# --- lab 09 ---------------------------------------------------------------------------------------

def distill_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import distill

    result = distill.experiment(spec["distill_seed"])
    rows = [row(lab="09", experiment="distillation", variant=name, case=f"seed {spec['distill_seed']}, digits",
                figure=result[name], unit="test accuracy") for name in ("teacher", "hard labels", "distilled")]
    # One request at a time on the CPU, as a small server without batching would see it.
    x = distill.digits_split(spec["distill_seed"])[2][:1]
    teacher, student = result["models"]["teacher"], result["models"]["distilled"]
    with torch.no_grad():
        cmp = timing.compare(lambda: student(x), lambda: teacher(x), reps=spec["reps"])
    params = result["params"]
    rows.append(_compared("09", "distillation", f"student, {params['student']} parameters",
                          f"teacher, {params['teacher']} parameters", "one request (batch 1), CPU", cmp))
    return rows


def separable_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import separable

    channels, size = spec["separable"]
    r = separable.batch1_comparison(channels, channels, size, reps=spec["reps"])
    case = f"{channels} -> {channels} channels, {size} x {size}, 3 x 3, batch 1, one thread"
    return [_compared("09", "depthwise-separable conv", "depthwise + pointwise", "standard 3 x 3", case, r["timing"],
                      figure=r["flop_ratio"], unit="FLOPs, separable / standard"),
            row(lab="09", experiment="depthwise-separable conv", variant="depthwise half", case=case,
                figure=r["depthwise_share"]["time"], unit="share of the separable block's time",
                note=f"{r['depthwise_share']['flops']:.4f} of its FLOPs")]


def sparse_rows(spec: dict, dev: str) -> list[dict]:
    from fastdl_lab import sparse

    n, densities = spec["sparse"]
    rows = [_compared("09", "sparse product", f"CSR at density {r['density']}", "dense matmul",
                      f"{n} x {n} times {n} x {n}, one thread", r["comparison"], figure=r["nnz"], unit="nonzeros")
            for r in sparse.density_sweep(n, densities, reps=spec["reps"])]
    return rows + [_gpu_only("09", "sparse product", "2:4 semi-structured", "a tensor-core format, Ampere and later")]


EXPERIMENTS = [im2col_rows, k_alignment_rows, scaled_add_rows, overhead_rows, breakdown_rows, pool_rows,
               compiled_step_rows, transfer_rows, ladder_rows, distill_rows, separable_rows, sparse_rows]


def benchmark(log: Log = print, size: str = "full") -> list[dict]:
    """Every experiment at ``size`` (``"full"``, or ``"quick"`` for a test), one line logged per row."""
    spec = BENCHMARK[size]
    dev = "cuda" if device.has_gpu() else "cpu"
    rows = []
    for experiment in EXPERIMENTS:
        for r in experiment(spec, dev):
            rows.append(r)
            shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in r.items() if v is not None and k not in ("lab", "experiment"))
            log(f"lab {r['lab']} {r['experiment']}: {shown}")
    return rows


def check() -> None:
    """The experiments run and their rows are whole at the quick size."""
    rows = benchmark(log=lambda _: None, size="quick")
    for r in rows:
        assert r["note"] or r["median_s"] is not None or r["figure"] is not None, r
    print(f"experiments: {len(rows)} rows at the quick size")
