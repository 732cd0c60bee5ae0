"""Figures for the lecture decks, drawn from the package's own experiments.

``python slides/deck_figures.py OUT_DIR`` writes one PNG per figure into OUT_DIR; the decks refer to
them as ``figures/<name>.png``, so OUT_DIR is the ``figures`` folder beside the built HTML
(``make slides`` does both). Every figure is a deterministic figure of the package (roofline
arithmetic, bytes, rounding, padding, a cost model), not a stopwatch reading: the slides look
the same whichever machine builds them, and building them takes seconds on a laptop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from fastdl_lab import device, fusion, layernorm, measure, memory  # noqa: E402
from fastdl_lab.amp import formats as amp_formats  # noqa: E402
from fastdl_lab.attention import reference as attention  # noqa: E402
from fastdl_lab.capstone import accounting, model as capstone_model  # noqa: E402
from fastdl_lab.data import text  # noqa: E402
from fastdl_lab.distributed import ring  # noqa: E402
from fastdl_lab.quant import formats as quant_formats  # noqa: E402

# Wide enough for a 16:9 slide at full width, small enough to keep every PNG under ~100 kB.
SIZE = (8.0, 4.0)
DPI = 110


def roofline(ax):
    """Matmuls of growing size and an element-wise add on the H100's fp16 roofline."""
    peak = device.PEAKS["h100"]
    roof = device.Roofline(bandwidth_gbs=peak.mem_bw_gbs, tflops=peak.fp16_tflops, dtype=torch.float16,
                           source="datasheet", device=peak.name)
    points = {}
    for n in (128, 512, 2048, 8192):
        flops = measure.matmul_flops_ref(n, n, n)
        intensity = measure.arithmetic_intensity_ref(flops, measure.matmul_bytes_ref(n, n, n, 2))
        points[f"matmul {n}³ fp16"] = (intensity, measure.attainable_tflops_ref(intensity, roof.tflops,
                                                                               roof.bandwidth_gbs))
    add = measure.arithmetic_intensity_ref(1, 3 * 2)  # one FLOP per two reads and a write of fp16
    points["element-wise add fp16"] = (add, measure.attainable_tflops_ref(add, roof.tflops, roof.bandwidth_gbs))
    measure.plot_roofline(roof, points, ax=ax, title=f"{peak.name}, fp16 tensor cores: best case per operation")


def gemm_intensity(ax):
    """A square matmul's intensity against n, and the ridge each course GPU puts it under."""
    ns = np.array([2 ** k for k in range(5, 15)])
    for dtype_name, size in (("fp32", 4), ("fp16", 2)):
        ax.loglog(ns, [measure.arithmetic_intensity_ref(measure.matmul_flops_ref(n, n, n),
                                                        measure.matmul_bytes_ref(n, n, n, size)) for n in ns],
                  marker="o", label=f"matmul intensity, {dtype_name}")
    for key, style in (("t4", ":"), ("a100", "--"), ("h100", "-.")):
        peak = device.PEAKS[key]
        ax.axhline(peak.fp16_tflops * 1e3 / peak.mem_bw_gbs, ls=style, color="grey",
                   label=f"{peak.name} fp16 ridge")
    ax.set_xlabel("n (square n × n × n matmul)")
    ax.set_ylabel("FLOP / byte")
    ax.set_title("Above its ridge a matmul is compute-bound: from n ≈ 1000 in fp16 on an H100", fontsize=10)
    ax.legend(fontsize=7)


def convbn_saved_bytes(ax):
    """Bytes kept for backward by Conv→BN training: the plain composition against recompute."""
    batches = [4, 8, 16, 32]
    plain, recompute = [], []
    for batch in batches:
        args = fusion.convbn_operands(batch=batch)
        plain.append(memory.saved_tensor_bytes(fusion.conv_bn_train_ref, *args) / 2 ** 20)
        recompute.append(memory.saved_tensor_bytes(fusion.conv_bn_train, *args) / 2 ** 20)
    x = np.arange(len(batches))
    ax.bar(x - 0.2, plain, 0.4, label="conv then batch norm (autograd)")
    ax.bar(x + 0.2, recompute, 0.4, label="ConvBN, conv output recomputed in backward")
    ax.set_xticks(x, [f"batch {b}" for b in batches])
    ax.set_ylabel("MiB saved for backward")
    ax.set_title("Saved-tensor bytes, 16→32 channels, 32×32 images (counted by saved-tensor hooks)", fontsize=10)
    ax.legend(fontsize=8)


def layernorm_stability(ax):
    """One-pass E[x²]−E[x]² against the two-pass reference as the rows' mean grows (fp32)."""
    means = [1.0, 10.0, 100.0, 300.0, 1e3, 3e3, 1e4]
    cols = 512
    weight, bias = torch.ones(cols), torch.zeros(cols)
    errors = {"one pass: E[x²] − E[x]²": [], "two passes (mean, then deviations)": []}
    for mean in means:
        x = layernorm.catastrophic_input(64, cols, mean=mean)
        for name, fn in zip(errors, (layernorm.naive_variance_layer_norm, layernorm.layer_norm_ref)):
            err = layernorm.stability_error(fn(x, weight, bias), x, weight, bias)
            # A NaN row (negative variance) is drawn at the top of the axis rather than dropped.
            errors[name].append(err if np.isfinite(err) else 1e3)
    for name, values in errors.items():
        ax.loglog(means, values, marker="o", label=name)
    ax.axhline(layernorm.STABLE_ATOL, ls=":", color="grey", label="the lab's tolerance")
    ax.set_xlabel("row mean (standard deviation 0.1)")
    ax.set_ylabel("max |error| vs fp64 (NaN drawn at 1e3)")
    ax.set_title("LayerNorm in fp32: the one-pass variance falls apart as the mean grows", fontsize=10)
    ax.legend(fontsize=8)


def gradient_underflow(ax):
    """Share of a log-normal gradient sample flushed to zero, or overflowing, per loss scale."""
    grads = amp_formats.gradient_sample()
    exponents = list(range(0, 41, 4))
    runs = [amp_formats.gradient_underflow(2.0 ** k, grads, names=("fp16", "bf16")) for k in exponents]
    for name, color in (("fp16", "tab:red"), ("bf16", "tab:blue")):
        ax.plot(exponents, [r["zero"][name] for r in runs], marker="o", color=color, label=f"{name}: flushed to 0")
        ax.plot(exponents, [r["overflow"][name] for r in runs], marker="x", ls="--", color=color,
                label=f"{name}: overflowed")
    ax.set_xlabel("loss scale 2^k (k)")
    ax.set_ylabel("fraction of gradients")
    ax.set_title("Loss scaling moves fp16 gradients out of the underflow zone, until the top overflows",
                 fontsize=10)
    ax.legend(fontsize=8)


def attention_traffic(ax):
    """HBM bytes of one attention head's forward pass: N×N materialised against FlashAttention."""
    ns = np.array([2 ** k for k in range(8, 16)])
    for method, label in (("naive", "naive: S and P written and read (4 N² passes)"),
                          ("flash", "FlashAttention: q, k, v, o and the row logsumexp")):
        ax.loglog(ns, [attention.attention_bytes(int(n), 64, 2, method=method) / 2 ** 20 for n in ns],
                  marker="o", label=label)
    ax.loglog(ns, [attention.attention_bytes(int(n), 64, 2, method="flash", block_m=128) / 2 ** 20 for n in ns],
              marker="x", ls="--", label="FlashAttention, k and v re-read per 128-row block (no cache)")
    ax.set_xlabel("sequence length N (head dim 64, fp16)")
    ax.set_ylabel("MiB moved, one head")
    ax.set_title("Attention's memory traffic: quadratic, or linear in N", fontsize=10)
    ax.legend(fontsize=8)


def padding(ax):
    """Padding fraction of the stdlib-docstring corpus under four batching schemes."""
    report = text.padding_report(text.docstring_lengths(), 32, 0, 256)
    names = {"pad_to_max": "pad to the longest", "random": "random batches", "bucketed": "length buckets",
             "packed": "packed rows"}
    bars = ax.bar(list(names.values()), [report[k] for k in names], color="tab:purple")
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel("fraction of token slots that are padding")
    ax.set_title("Real text lengths (stdlib docstrings), batch 32, at most 256 tokens", fontsize=10)


def allreduce_model(ax):
    """The alpha-beta model of an all-reduce on 8 ranks: ring, tree and a root that does it all."""
    sizes = np.logspace(3, 9, 40)
    alpha, beta = 5e-6, 25e9  # a message's latency and one link's bandwidth, typical of a fast fabric
    for algorithm in ("ring", "tree", "root"):
        ax.loglog(sizes, [ring.allreduce_time_model(s, 8, alpha, beta, algorithm) for s in sizes], label=algorithm)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("seconds (model)")
    ax.set_title("All-reduce on 8 ranks, α = 5 µs, β = 25 GB/s: tree for small tensors, ring for large",
                 fontsize=10)
    ax.legend(fontsize=8)


def int8_error(ax):
    """Round-trip error of a trained layer quantised with one scale, or one scale per output row."""
    w = quant_formats.trained_layer()
    bits = [3, 4, 5, 6, 7, 8]
    for axis, label in ((None, "per tensor"), (0, "per channel (row)")):
        ax.plot(bits, [quant_formats.quantization_error(w, bits=b, axis=axis)["sqnr_db"] for b in bits],
                marker="o", label=label)
    ax.set_xlabel("bits")
    ax.set_ylabel("signal-to-quantisation-noise (dB)")
    ax.set_title(f"A trained 128×32 layer, rows' ranges {quant_formats.row_range_ratio(w):.1f}× apart", fontsize=10)
    ax.legend(fontsize=8)


def capstone_memory(ax):
    """A training step's four parts, counted by storage: the lab's CPU model at batch 8 with the fused
    attention, with the attention written out, and with every block checkpointed."""
    config, batch = capstone_model.CPU_CONFIG, 8
    variants = {"fused attention": {}, "attention written out": {"attention": "math"},
                f"fused, all {config.n_layer} blocks checkpointed": {"recompute_blocks": config.n_layer}}
    splits = {name: accounting.measure(config, batch, **options) for name, options in variants.items()}
    x = np.arange(len(accounting.PARTS))
    width = 0.8 / len(splits)
    for i, (name, split) in enumerate(splits.items()):
        bars = ax.bar(x + (i - (len(splits) - 1) / 2) * width, [split[p] / 1e6 for p in accounting.PARTS], width,
                      label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(x, ["weights", "gradients", "AdamW moments", "saved activations"])
    ax.set_ylabel("MB")
    ax.set_title(f"A step's memory, fp32: d = {config.d_model}, {config.n_layer} blocks, {config.seq_len} tokens, "
                 f"batch {batch} (counted by storage)", fontsize=10)
    ax.legend(fontsize=8)


FIGURES: dict[str, Callable] = {
    "roofline": roofline,
    "gemm_intensity": gemm_intensity,
    "convbn_saved_bytes": convbn_saved_bytes,
    "layernorm_stability": layernorm_stability,
    "gradient_underflow": gradient_underflow,
    "attention_traffic": attention_traffic,
    "padding": padding,
    "allreduce_model": allreduce_model,
    "int8_error": int8_error,
    "capstone_memory": capstone_memory,
}


def write_all(out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in FIGURES.items():
        fig, ax = plt.subplots(figsize=SIZE)
        draw(ax)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        # No timestamp in the PNG's metadata: the same package draws the same bytes.
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python slides/deck_figures.py OUT_DIR  (the figures/ folder beside the built decks)")
    for path in write_all(Path(sys.argv[1])):
        print(path)
