"""Hardware and timing: what this machine can do, and how to measure it honestly (lab 00 measure).

- Roofline arithmetic for a matrix multiply: FLOPs, the least bytes it must move, arithmetic
  intensity, the attainable FLOP/s under both roofs, and model FLOP utilisation (MFU).
- ``compute_bound_batch_ref``: the batch from which a linear layer is compute-bound, if any.
- ``plot_roofline``: both roofs on log-log axes with operations placed on them.
- ``SimulatedAsyncDevice``: a deterministic stand-in for a GPU stream on the CPU, so that the
  timing pitfalls of asynchronous launches can be shown and graded on a machine without a GPU.
  ``time_op_naive`` is the broken timing loop; ``time_op_ref`` the correct one.
- ``hardware_columns`` / ``append_results``: the hardware record every benchmark row carries.
"""

from __future__ import annotations

import csv
import datetime
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from pathlib import Path

import torch

from fastdl_lab import device

# ---------------------------------------------------------------------------------------------
# Roofline arithmetic


def matmul_flops_ref(m: int, n: int, k: int) -> int:
    """FLOPs of (m x k) @ (k x n): one multiply and one add per term of every output's sum."""
    ### BEGIN SOLUTION
    return 2 * m * n * k
    ### END SOLUTION


def matmul_bytes_ref(m: int, n: int, k: int, bytes_per_elem: int) -> int:
    """The least traffic a matmul can have: A and B read once, C written once."""
    ### BEGIN SOLUTION
    return (m * k + k * n + m * n) * bytes_per_elem
    ### END SOLUTION


def arithmetic_intensity_ref(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte of memory traffic."""
    ### BEGIN SOLUTION
    return flops / bytes_moved
    ### END SOLUTION


def attainable_tflops_ref(intensity: float, peak_tflops: float, peak_bw_gbs: float) -> float:
    """The roofline: the lower of the compute roof and what the bandwidth can feed (TFLOP/s)."""
    ### BEGIN SOLUTION
    # GB/s x FLOP/B = GFLOP/s; a thousand of those make a TFLOP/s.
    return min(peak_tflops, intensity * peak_bw_gbs / 1e3)
    ### END SOLUTION


def mfu_ref(achieved_tflops: float, peak_tflops: float) -> float:
    """Model FLOP utilisation: the fraction of the peak that the useful FLOPs achieved."""
    ### BEGIN SOLUTION
    return achieved_tflops / peak_tflops
    ### END SOLUTION


def compute_bound_batch_ref(d_in: int, d_out: int, bytes_per_elem: int, peak_tflops: float,
                            peak_bw_gbs: float) -> int | None:
    """Smallest batch ``b >= 1`` at which a linear layer, (b x d_in) @ (d_in x d_out) with the least
    traffic, has an arithmetic intensity of at least the machine's ridge point; None if none does.
    """
    ### BEGIN SOLUTION
    # Exact rationals: the answer is an integer threshold, and floats near it could round either way.
    ridge = Fraction(peak_tflops) * 1000 / Fraction(peak_bw_gbs)
    # Intensity 2 b d_in d_out / ((b d_in + d_in d_out + b d_out) e) grows with b towards
    # 2 d_in d_out / ((d_in + d_out) e): the weights are read once whatever the batch.
    slope = 2 * d_in * d_out - ridge * bytes_per_elem * (d_in + d_out)
    if slope <= 0:
        return None
    return max(1, math.ceil(ridge * bytes_per_elem * d_in * d_out / slope))
    ### END SOLUTION


def peaks_table():
    """The datasheet peaks of the course GPUs, with the ridge points they imply, as a DataFrame."""
    import pandas as pd

    rows = {}
    for key, p in device.PEAKS.items():
        rows[key] = {
            "name": p.name, "fp32 TFLOP/s": p.fp32_tflops, "tf32 TFLOP/s": p.tf32_tflops,
            "fp16 TFLOP/s": p.fp16_tflops, "bf16 TFLOP/s": p.bf16_tflops, "GB/s": p.mem_bw_gbs,
            "memory GB": p.memory_gb, "SMs": p.sm_count,
            # FLOP per byte needed before compute, not memory, becomes the limit.
            "ridge fp32": p.fp32_tflops * 1e3 / p.mem_bw_gbs,
            "ridge fp16": p.fp16_tflops * 1e3 / p.mem_bw_gbs,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def plot_roofline(roofline, points: Mapping[str, tuple[float, float]], ax=None, title: str | None = None):
    """Draw ``roofline`` (anything with ``bandwidth_gbs`` and ``tflops``) and place ``points``.

    ``points`` maps a label to (arithmetic intensity in FLOP/byte, achieved TFLOP/s).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    for name, (intensity, tflops) in points.items():
        if not (intensity > 0 and tflops > 0):
            raise ValueError(f"{name}: log axes need positive intensity and TFLOP/s, got {intensity}, {tflops}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    bw, peak = roofline.bandwidth_gbs, roofline.tflops
    ridge = peak * 1e3 / bw
    xs_of_interest = [ridge] + [i for i, _ in points.values()]
    xs = np.geomspace(min(xs_of_interest) / 8, max(xs_of_interest) * 8, 256)
    memory_roof = xs * bw / 1e3
    # The roofs extended past the ridge, faintly, show which limit a point sits under.
    ax.loglog(xs, memory_roof, ls="--", color="tab:blue", alpha=0.4, label=f"bandwidth roof {bw:,.0f} GB/s")
    ax.loglog(xs, np.full_like(xs, peak), ls="--", color="tab:red", alpha=0.4,
              label=f"compute roof {peak:.3g} TFLOP/s")
    ax.loglog(xs, np.minimum(memory_roof, peak), color="black", lw=2, label="attainable")
    ax.axvline(ridge, ls=":", color="grey", label=f"ridge {ridge:.3g} FLOP/B")
    # Labels go in the legend: points of similar intensity would overprint annotations.
    for name, (intensity, tflops) in points.items():
        ax.scatter([intensity], [tflops], zorder=3, label=name)
    ax.set_ylim(min([memory_roof[0]] + [t for _, t in points.values()]) / 2, peak * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7, loc="lower right")
    if title is None:
        title = f"roofline of {getattr(roofline, 'device', 'this machine')} ({getattr(roofline, 'source', '')})"
    ax.set_title(title, fontsize=10)
    return ax


# ---------------------------------------------------------------------------------------------
# Asynchronous execution, simulated


class SimulatedAsyncDevice:
    """A CPU stand-in for a GPU stream: launches return at once, the work runs on a worker thread.

    Every launched op occupies the worker for ``op_seconds`` (a sleep, so the figures are the
    same on a busy laptop and an idle server). The device's first op takes ``compile_seconds``
    longer, standing for what a real first call pays: JIT compilation, lazy module loading,
    clocks ramping up from idle. ``synchronize`` blocks until everything launched has run;
    ``result`` does too, like ``tensor.item()`` on a CUDA tensor, because the value it returns
    only exists once the work is done.
    """

    def __init__(self, op_seconds: float = 0.02, compile_seconds: float = 0.4):
        if op_seconds < 0 or compile_seconds < 0:
            raise ValueError("op_seconds and compile_seconds must be >= 0")
        self.op_seconds = op_seconds
        self.compile_seconds = compile_seconds
        self.launched = 0
        self.completed = 0
        self._compiled = False
        self._value = None
        self._error: BaseException | None = None
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="simulated-device", daemon=True)
        self._worker.start()

    def launch(self, op: Callable[[], object] | None = None) -> None:
        """Enqueue one op (``op()`` is called on the worker, its value kept for ``result``)."""
        if self._closed:
            raise RuntimeError("device is closed")
        seconds = self.op_seconds
        if not self._compiled:
            seconds += self.compile_seconds
            self._compiled = True
        self.launched += 1
        self._queue.put((seconds, op))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                seconds, op = item
                time.sleep(seconds)
                try:
                    self._value = op() if op is not None else self.completed + 1
                except BaseException as exc:  # noqa: BLE001  (re-raised on the host at the next sync)
                    self._error = exc
                self.completed += 1
            finally:
                self._queue.task_done()

    @property
    def pending(self) -> int:
        """Ops launched but not finished yet."""
        return self.launched - self.completed

    def synchronize(self) -> None:
        """Block until every launched op has finished; an op's error surfaces here, as on a GPU."""
        self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("an op launched on the simulated device failed") from error

    def result(self):
        """The last op's value (by default, how many ops have finished); waits for it first."""
        self.synchronize()
        return self._value

    def close(self) -> None:
        """Finish the queued work, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._worker.join()

    def __enter__(self) -> SimulatedAsyncDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"SimulatedAsyncDevice(op_seconds={self.op_seconds}, compile_seconds={self.compile_seconds}, "
                f"launched={self.launched}, pending={self.pending})")


def time_op_naive(dev: SimulatedAsyncDevice, iters: int) -> list[float]:
    """The loop that lies, one sample per iteration: no warm-up and no synchronize, so each
    sample is the time to enqueue the op."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        samples.append(time.perf_counter() - start)
    return samples


def time_op_ref(dev: SimulatedAsyncDevice, iters: int = 10, warmup: int = 2) -> list[float]:
    """Seconds per op, one sample per iteration: warmed up, and each launch waited for."""
    ### BEGIN SOLUTION
    for _ in range(warmup):
        dev.launch()
    # Work queued before the timer starts would otherwise be billed to the first sample.
    dev.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        samples.append(time.perf_counter() - start)
    return samples
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Benchmark records

RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def hardware_columns() -> dict[str, object]:
    """Where and when a benchmark row was measured; prepended to every recorded row."""
    d = device.info()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_kind": d.kind, "device_name": d.name, "sm_count": d.sm_count, "cpu_count": d.cpu_count,
        "torch": d.torch_version, "triton": d.triton_version, "cuda": d.cuda_version, "driver": d.driver,
    }


def append_results(name: str, rows: Iterable[Mapping[str, object]], directory: Path | None = None) -> Path:
    """Append ``rows`` with hardware columns to ``<directory>/<name>.csv``, keeping one header."""
    path = Path(directory or RESULTS_DIR) / f"{name}.csv"
    records = [{**hardware_columns(), **row} for row in rows]
    if not records:
        return path
    fields = list(records[0])
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            existing = next(csv.reader(f))
        if existing != fields:
            raise ValueError(f"{path} has columns {existing}, new rows have {fields}; "
                             "move the old file aside or keep the benchmark's columns stable")
        write_header = False
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_header = True
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if write_header:
            writer.writeheader()
        writer.writerows(records)
    return path


# ---------------------------------------------------------------------------------------------
# Benchmark spec: the measured roofs, and a few operations placed under them.

BENCHMARK = {
    "name": "measure",
    "cpu": {"roofline": {"copy_bytes": 64 << 20, "matmul_n": 1024}, "vector_n": 1 << 24,
            "matmul_sizes": [64, 256, 1024], "dtypes": [torch.float32]},
    "gpu": {"roofline": {"copy_bytes": 1 << 30, "matmul_n": 8192}, "vector_n": 1 << 26,
            "matmul_sizes": [256, 1024, 4096, 8192], "dtypes": [torch.float32, torch.float16]},
    # Timing an asynchronous launch without a synchronize is only a lesson on a GPU.
    "gpu_only": ["launch_only"],
}


def _op_row(op: str, size: str, dtype: torch.dtype, timing, roof, flops: float | None = None,
            bytes_moved: float | None = None, speedup: float | None = None) -> dict[str, object]:
    intensity = arithmetic_intensity_ref(flops, bytes_moved) if flops and bytes_moved else None
    tflops = flops / timing.median / 1e12 if flops else None
    attainable = attainable_tflops_ref(intensity, roof.tflops, roof.bandwidth_gbs) if intensity else None
    return {
        "op": op, "size": size, "dtype": str(dtype).replace("torch.", ""),
        "median_s": timing.median, "iqr_s": timing.iqr, "tflops": tflops,
        "gbs": bytes_moved / timing.median / 1e9 if bytes_moved else None, "intensity": intensity,
        "fraction_of_roof": tflops / attainable if attainable else None, "speedup": speedup,
    }


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def benchmark(log: Callable[[str], None] = print) -> list[dict[str, object]]:
    """Measure the roofs, then place a vector add and square matmuls under them."""
    from fastdl_lab import timing

    gpu = device.has_gpu()
    spec = BENCHMARK["gpu" if gpu else "cpu"]
    dev = "cuda" if gpu else "cpu"
    rows = []
    for dtype in spec["dtypes"]:
        roof = device.measure_roofline(dtype=dtype, **spec["roofline"])
        rows.append({"op": "roof", "size": "", "dtype": str(dtype).replace("torch.", ""), "median_s": None,
                     "iqr_s": None, "tflops": roof.tflops, "gbs": roof.bandwidth_gbs,
                     "intensity": roof.ridge_intensity, "fraction_of_roof": 1.0, "speedup": None})
        width = dtype.itemsize
        n = spec["vector_n"]
        x, y = torch.ones(n, dtype=dtype, device=dev), torch.ones(n, dtype=dtype, device=dev)
        out = torch.empty_like(x)
        t = timing.bench(lambda: torch.add(x, y, out=out), warmup=2, reps=10)
        # One add per element; two reads and one write.
        rows.append(_op_row("vector_add", str(n), dtype, t, roof, n, 3 * n * width))
        for m in spec["matmul_sizes"]:
            a = torch.randn(m, m, device=dev).to(dtype)
            b = torch.randn(m, m, device=dev).to(dtype)
            c = torch.empty_like(a)
            t = timing.bench(lambda: torch.mm(a, b, out=c), warmup=2, reps=10)
            rows.append(_op_row("matmul", f"{m}x{m}x{m}", dtype, t, roof, matmul_flops_ref(m, m, m),
                                matmul_bytes_ref(m, m, m, width)))
            if gpu:
                # Host clock and no synchronize: this times the launch, not the kernel. The
                # speedup column says how much faster than the truth the broken figure looks.
                launch = timing.bench(lambda: torch.mm(a, b, out=c), warmup=2, reps=10, sync=False)
                device.synchronize()
                rows.append(_op_row("launch_only", f"{m}x{m}x{m}", dtype, launch, roof,
                                    speedup=t.median / launch.median))
    for row in rows:
        log(f"{row['op']:>12} {row['size']:>12} {row['dtype']:>8}: "
            f"{_fmt(row['median_s'], '10.4f', 1e3)} ms {_fmt(row['tflops'], '9.4f')} TFLOP/s "
            f"{_fmt(row['gbs'], '9.2f')} GB/s AI {_fmt(row['intensity'], '.3g')} "
            f"({_fmt(row['fraction_of_roof'], '.0%')} of roof)")
    if not gpu:
        log(f"{', '.join(BENCHMARK['gpu_only'])}: needs a GPU (CPU ops run synchronously)")
    return rows


def check() -> None:
    """The calculators on known values and the two timing loops on a fast simulated device."""
    assert matmul_flops_ref(2, 3, 4) == 48
    assert matmul_bytes_ref(2, 3, 4, 4) == 104
    assert attainable_tflops_ref(1.0, 100.0, 2000.0) == 2.0
    with SimulatedAsyncDevice(op_seconds=0.005, compile_seconds=0.05) as dev:
        naive = time_op_naive(dev, 5)
        samples = time_op_ref(dev, iters=5, warmup=1)
    assert max(naive) < 0.005 <= min(samples) and max(samples) < 0.05, (naive, samples)
    print(f"measure: checks passed (naive {max(naive) * 1e6:.1f} us vs synced {min(samples) * 1e3:.2f} ms)")


if __name__ == "__main__":
    check()
    benchmark()
