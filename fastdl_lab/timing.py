"""The one timing harness: every lab, test, benchmark and the grader times code through here.

Rules it enforces (lab 00 teaches why):

* warm-up calls are run and discarded, so JIT compilation and autotuning are never timed;
* on a GPU each call is bracketed by CUDA events on the current stream, recorded right after the
  call is launched, and the host synchronises the whole device once after the round, so calls
  queue up back to back and the timer measures device work, not launch latency or host gaps; L2
  is flushed before every call (outside its events) so each one starts cold, as it would inside
  a real model. Work counts when it is ordered before the end event: on the current stream, or
  on a side stream the call joins back to it (``wait_stream``), the contract every caller of a
  CUDA op relies on; or work the call waits for on the host before it returns (the end event is
  queued after that). A call that leaves work running on another stream after its own stream is
  done would escape its events, so it is refused (``UnjoinedWork``), see ``_device_tail``;
* on the CPU each sample is ``time.perf_counter`` around the call. A call shorter than
  ``MIN_SAMPLE_S`` is repeated ``k`` times inside one sample and the sample is the total over
  ``k``, with ``k`` chosen from the last warm-up call, because a timer read and a Python loop step
  are not negligible next to a few microseconds. ``Timing.batch`` records ``k``. GPU samples are
  always one call: events resolve microseconds and each call must see a flushed cache;
* statistics are medians and inter-quartile ranges, robust to the odd preempted sample;
* two candidates are compared A/B interleaved in one process, in a random order per pair, so
  clock boost, thermal drift and noisy neighbours hit both alike.

All times are in seconds.
"""

from __future__ import annotations

import contextlib
import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fastdl_lab import device

MIN_SAMPLE_S = 100e-6
MAX_BATCH = 10_000
DEFAULT_FLUSH_BYTES = 256 << 20
# How long the device may stay busy once the timed stream is done (beyond what synchronising an
# idle device costs) before the work still running is called unjoined: above the jitter of a
# synchronize, below any kernel worth hiding.
UNJOINED_TAIL_S = 200e-6

# The instruments, bound when this module is imported. The grading child imports it before any
# student code exists and checks afterwards that none of these was replaced, so rebinding
# time.perf_counter or torch.cuda.Event's methods later cannot reach the clock.
_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_record = torch.cuda.Event.record
_elapsed_ms = torch.cuda.Event.elapsed_time
_wait_event = torch.cuda.Event.synchronize
_synchronize = torch.cuda.synchronize
INSTRUMENTS = ("time.perf_counter", "torch.cuda.Event", "torch.cuda.Event.record", "torch.cuda.Event.elapsed_time",
               "torch.cuda.Event.synchronize", "torch.cuda.synchronize")


class UnjoinedWork(RuntimeError):
    """A timed call left work on another stream that its end event does not wait for."""

# --------------------------------------------------------------------------------------------
# Results


def _format_seconds(seconds: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(seconds) >= scale:
            return scale, unit
    return 1e-9, "ns"


@dataclass
class Timing:
    samples: list[float]
    batch: int = 1

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        q1, q3 = np.percentile(self.samples, [25, 75])
        return float(q1), float(q3)

    @property
    def iqr(self) -> float:
        q1, q3 = self.quartiles
        return q3 - q1

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.samples) if self.n > 1 else 0.0

    def as_dict(self) -> dict:
        return {"median_s": self.median, "iqr_s": self.iqr, "mean_s": self.mean,
                "min_s": self.min, "stdev_s": self.stdev, "n": self.n, "batch": self.batch,
                "samples_s": list(self.samples)}

    def __str__(self) -> str:
        scale, unit = _format_seconds(self.median)
        return (f"{self.median / scale:.3g} {unit} ± {self.iqr / 2 / scale:.2g} "
                f"(median ± IQR/2, n={self.n})")


@dataclass
class Comparison:
    candidate: Timing
    baseline: Timing
    speedup: float
    ci_low: float
    ci_high: float

    @classmethod
    def from_timings(cls, candidate: Timing, baseline: Timing, *, seed: int = 0,
                     resamples: int = 1000) -> Comparison:
        """Speedup = median(baseline) / median(candidate), with a seeded bootstrap 95% CI."""
        rng = np.random.default_rng(seed)
        cand = np.asarray(candidate.samples)
        base = np.asarray(baseline.samples)
        # Resample each side independently and take the ratio of medians each time.
        cand_medians = np.median(rng.choice(cand, (resamples, cand.size)), axis=1)
        base_medians = np.median(rng.choice(base, (resamples, base.size)), axis=1)
        low, high = np.percentile(base_medians / cand_medians, [2.5, 97.5])
        return cls(candidate, baseline, speedup=baseline.median / candidate.median,
                   ci_low=float(low), ci_high=float(high))

    def as_dict(self) -> dict:
        return {"speedup": self.speedup, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "candidate": self.candidate.as_dict(), "baseline": self.baseline.as_dict()}

    def __str__(self) -> str:
        return (f"speedup {self.speedup:.2f}x (95% CI {self.ci_low:.2f}-{self.ci_high:.2f}); "
                f"candidate {self.candidate}; baseline {self.baseline}")


# --------------------------------------------------------------------------------------------
# Measurement


@contextlib.contextmanager
def _num_threads(threads: int | None):
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _flusher(enabled: bool) -> Callable[[], None]:
    if not enabled:
        return lambda: None
    peak = device.datasheet_peak()
    nbytes = int(2 * peak.l2_mb * 2**20) if peak else DEFAULT_FLUSH_BYTES
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if device.has_gpu() else "cpu")
    # Writing the buffer evicts whatever the previous call left in the cache.
    return buffer.zero_


def _host_sample(fn: Callable, k: int, sync: bool) -> tuple[Callable[[], float], None]:
    if sync:
        device.synchronize()
    start = _perf_counter()
    for _ in range(k):
        fn()
    if sync:
        device.synchronize()
    elapsed = (_perf_counter() - start) / k
    return (lambda: elapsed), None


def _event_sample(fn: Callable, k: int, sync: bool) -> tuple[Callable[[], float], torch.cuda.Event]:
    start, end = _Event(enable_timing=True), _Event(enable_timing=True)
    _record(start)
    for _ in range(k):
        fn()
    # The end event goes in right behind the call: a synchronize here would leave the device
    # idle until the host queued the event, and the sample would time the host. Nothing waits
    # in the middle of a round; _measure synchronises the device once after its last call.
    _record(end)
    # Read only after the round's synchronize; elapsed_time is in milliseconds.
    return (lambda: _elapsed_ms(start, end) / 1e3 / k), end


def _device_tail(after: torch.cuda.Event) -> float:
    """Seconds the device stays busy once ``after`` (the last end event) has completed, less what
    synchronising an idle device costs: the time of work left on other streams."""
    _wait_event(after)
    began = _perf_counter()
    _synchronize()
    busy = _perf_counter() - began
    began = _perf_counter()
    _synchronize()
    return busy - (_perf_counter() - began)


def _check_joined(after: torch.cuda.Event, what: str) -> None:
    tail = _device_tail(after)
    if tail > UNJOINED_TAIL_S:
        raise UnjoinedWork(f"{what} left {tail * 1e3:.2f} ms of work on another stream after its end event: join the "
                           "side stream to the current one (torch.cuda.current_stream().wait_stream(side)) so the "
                           "timer sees it")


def _probe_streams(fn: Callable) -> None:
    """Refuse ``fn`` if one call leaves work running beyond its own stream (see UnjoinedWork)."""
    _synchronize()
    end = _Event()
    fn()
    _record(end)
    _check_joined(end, "one call")


def _warm_up(fn: Callable, warmup: int, sync: bool) -> float | None:
    """Run the warm-up calls; return how long the last one took on the host (None if none)."""
    last = None
    for _ in range(warmup):
        last = _host_sample(fn, 1, sync)[0]()
    return last


def _batch_size(last_call_s: float | None) -> int:
    if last_call_s is None or last_call_s >= MIN_SAMPLE_S:
        return 1
    return min(MAX_BATCH, math.ceil(MIN_SAMPLE_S / max(last_call_s, 1e-9)))


def _measure(fns: list[Callable], *, warmup: int, reps: int, min_run_s: float,
             threads: int | None, flush_l2: bool | None, sync: bool | None,
             rng: random.Random | None, phase: Callable[[str], None] | None = None) -> list[Timing]:
    """Time every fn ``reps`` times (more rounds while under ``min_run_s``), interleaved.

    ``phase("start")`` is called once the warm-up is over and ``phase("end")`` once the last
    sample is read: the grader's parent clocks the timed phase between the two.
    """
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got reps={reps}, warmup={warmup}")
    gpu = device.has_gpu()
    use_events = gpu and sync is None
    host_sync = gpu and sync is not False
    sample = _event_sample if use_events else _host_sample
    flush = _flusher(gpu if flush_l2 is None else flush_l2)
    samples: list[list[float]] = [[] for _ in fns]
    with _num_threads(threads):
        last_warm = [_warm_up(fn, warmup, host_sync) for fn in fns]
        batches = [1 if use_events else _batch_size(t) for t in last_warm]
        if use_events:
            for fn in fns:
                _probe_streams(fn)
        if phase is not None:
            phase("start")
        while True:
            pending: list[list[Callable[[], float]]] = [[] for _ in fns]
            last_end = None
            for _ in range(reps):
                order = list(range(len(fns)))
                if rng is not None:
                    rng.shuffle(order)
                for i in order:
                    flush()
                    read, last_end = sample(fns[i], batches[i], host_sync)
                    pending[i].append(read)
            if use_events:
                # The round's one device-wide synchronize, after its last end event: it drains
                # every stream before any event is read, and refuses work left running past it.
                _check_joined(last_end, "a round of timed calls")
            for i, round_samples in enumerate(pending):
                samples[i].extend(read() for read in round_samples)
            if min(sum(s) * b for s, b in zip(samples, batches)) >= min_run_s:
                break
    if phase is not None:
        phase("end")
    return [Timing(s, batch=b) for s, b in zip(samples, batches)]


def bench(fn: Callable, *, warmup: int = 3, reps: int = 20, min_run_s: float = 0.0,
          threads: int | None = None, flush_l2: bool | None = None,
          sync: bool | None = None) -> Timing:
    """Time ``fn()``: ``warmup`` discarded calls, then at least ``reps`` samples.

    ``min_run_s``: whole rounds of ``reps`` samples are added until the timed calls total at
    least this long. ``threads``: torch's intra-op thread count for the duration (restored after).
    ``flush_l2``: overwrite a buffer of twice the L2 before each sample (default: on a GPU only).
    ``sync``: None picks the right clock (CUDA events on a GPU, perf_counter on the CPU). On a GPU,
    True times on the host clock with a device synchronize before and after each call (launch
    overhead included) and False times on the host clock with no synchronize at all, which only
    measures how long launching takes; lab 00 shows the difference. On the CPU both equal None.
    """
    return _measure([fn], warmup=warmup, reps=reps, min_run_s=min_run_s, threads=threads,
                    flush_l2=flush_l2, sync=sync, rng=None)[0]


def compare(candidate: Callable, baseline: Callable, *, warmup: int = 3, reps: int = 20,
            threads: int | None = None, flush_l2: bool | None = None,
            seed: int = 0, phase: Callable[[str], None] | None = None,
            min_run_s: float = 0.0) -> Comparison:
    """A/B-time two callables interleaved call by call, each pair in a seeded random order.
    ``phase``: told "start" and "end" around the timed samples (after the warm-up).
    ``min_run_s``: whole rounds are added until each side's timed calls total this long."""
    cand, base = _measure([candidate, baseline], warmup=warmup, reps=reps, min_run_s=min_run_s,
                          threads=threads, flush_l2=flush_l2, sync=None,
                          rng=random.Random(seed), phase=phase)
    return Comparison.from_timings(cand, base, seed=seed)


# --------------------------------------------------------------------------------------------
# Presentation


def table(results: dict[str, Timing | Comparison]):
    """One row per name: the timing's (or the comparison candidate's) statistics in seconds."""
    import pandas as pd

    rows = {}
    for name, result in results.items():
        timing = result.candidate if isinstance(result, Comparison) else result
        row = {"median_s": timing.median, "iqr_s": timing.iqr, "min_s": timing.min,
               "n": timing.n, "baseline_median_s": math.nan, "speedup": math.nan,
               "ci_low": math.nan, "ci_high": math.nan}
        if isinstance(result, Comparison):
            row.update(baseline_median_s=result.baseline.median, speedup=result.speedup,
                       ci_low=result.ci_low, ci_high=result.ci_high)
        rows[name] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def plot(results: dict[str, Timing | Comparison], ax=None, title: str | None = None):
    """Bar chart of medians with inter-quartile error bars; a comparison draws both bars."""
    import matplotlib.pyplot as plt

    bars: list[tuple[str, Timing]] = []
    for name, result in results.items():
        if isinstance(result, Comparison):
            bars += [(f"{name}\n({result.speedup:.2f}x)", result.candidate),
                     (f"{name}: baseline", result.baseline)]
        else:
            bars.append((name, result))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(bars)), 3.5))
    scale, unit = _format_seconds(max((t.median for _, t in bars), default=1.0))
    medians = [t.median / scale for _, t in bars]
    quartiles = [t.quartiles for _, t in bars]
    below = [m - q1 / scale for m, (q1, _) in zip(medians, quartiles)]
    above = [q3 / scale - m for m, (_, q3) in zip(medians, quartiles)]
    ax.bar([label for label, _ in bars], medians, yerr=[below, above], capsize=4)
    ax.set_ylabel(f"median time ({unit})")
    if title:
        ax.set_title(title)
    return ax


def plot_samples(samples: dict[str, list[float]], truth_s: float | None = None, ax=None, title: str | None = None):
    """Strip plot of per-iteration times (seconds): one column per loop, its iterations as dots
    from left to right with the first ringed, its mean as a bar, on a log axis in milliseconds.

    Where a loop's average hides what happened (one slow first call, every call far too fast),
    the dots show it; ``truth_s`` draws the time the op really takes.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.5, 2.0 * len(samples)), 3.6))
    for col, (name, values) in enumerate(samples.items()):
        ms = np.asarray(values, dtype=float) * 1e3
        if ms.size == 0 or not (ms > 0).all():
            raise ValueError(f"{name}: a log axis needs at least one sample, all positive")
        xs = col + (np.linspace(-0.25, 0.25, ms.size) if ms.size > 1 else np.zeros(1))
        ax.scatter(xs, ms, s=16, color="tab:blue", zorder=3, label="one iteration" if col == 0 else None)
        ax.scatter(xs[:1], ms[:1], s=70, facecolors="none", edgecolors="tab:red", zorder=4,
                   label="first iteration" if col == 0 else None)
        ax.hlines(ms.mean(), col - 0.35, col + 0.35, colors="black", lw=1.5,
                  label="mean: what one average reports" if col == 0 else None)
    if truth_s is not None:
        ax.axhline(truth_s * 1e3, ls="--", color="grey", label=f"the op's true time, {truth_s * 1e3:.3g} ms")
    ax.set_yscale("log")
    ax.set_xticks(range(len(samples)), list(samples), fontsize=8)
    ax.set_xlim(-0.6, len(samples) - 0.4)
    ax.set_ylabel("ms per iteration (log)")
    # Slow samples sit high, so the bottom right is where a legend hides the least.
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    return ax
