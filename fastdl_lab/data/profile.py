"""Profiling a training step: a Chrome trace, what it says, FLOPs and MFU (lab 06 profiling).

- ``profile_steps`` runs a step under ``torch.profiler`` and writes a Chrome trace (open it in
  Perfetto or ``chrome://tracing``) into ``trace_dir()``.
- ``summarise_trace`` reads such a trace file, not the live profiler, so a trace from any machine
  can be studied anywhere: the ops that take the host's time, the stretches where the main thread
  ran no op at all (Python, a metric library, a collate: the device starves there), and the events
  that make the host wait for the device.
- ``timeline`` / ``plot_timeline``: the main thread's busy stretches and gaps, drawn as bars.
- ``step_flops``: the useful FLOPs of one step; divided by the step time and lab 00's measured or
  datasheet peak, they give the step's MFU.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastdl_lab import device

_REPO = Path(__file__).resolve().parents[2]
_fallback_dir: Path | None = None

# Host-side names of waits for the device. Copies into host memory show on the GPU's own
# timeline as "Memcpy DtoH ..." (matched apart, by substring).
SYNC_EVENTS = (
    "aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
    "aten::unique_consecutive", "aten::bincount", "aten::equal", "aten::allclose",
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
)
# What counts as work on the host's timeline; ProfilerStep#N spans a whole step, so it is the
# frame, not a piece of work.
_HOST_WORK = ("cpu_op", "user_annotation", "cuda_runtime")


def trace_dir() -> Path:
    """Where traces go: ``$FASTDL_TRACE_DIR``, else ``<repo>/build/traces`` if writable, else a temp dir."""
    global _fallback_dir
    chosen = os.environ.get("FASTDL_TRACE_DIR")
    if chosen:
        path = Path(chosen)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = _REPO / "build" / "traces"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK | os.X_OK):
            return path
    except OSError:
        pass
    if _fallback_dir is None or not _fallback_dir.is_dir():
        _fallback_dir = Path(tempfile.mkdtemp(prefix="fastdl-traces-"))
    return _fallback_dir


def profile_steps(step: Callable[[], object], *, steps: int = 5, warmup: int = 2, name: str = "step") -> Path:
    """Call ``step`` 1 + ``warmup`` + ``steps`` times under the profiler; the Chrome trace's path.

    The first call runs unprofiled and the warm-up calls are profiled but thrown away, so lazy
    initialisation and the profiler's own start-up stay out of the ``steps`` recorded ones. No
    synchronisation is added between steps (it would show up as a sync the step never made); the
    profiler waits for the device once, when it stops.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, not {steps} and {warmup}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.has_gpu() else [])
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "step"
    path = trace_dir() / f"{safe}-{os.getpid()}-{time.time_ns()}.json"
    with profile(activities=activities, schedule=schedule(wait=1, warmup=warmup, active=steps, repeat=1),
                 record_shapes=True, on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
        for _ in range(1 + warmup + steps):
            step()
            prof.step()
    return path


# ---------------------------------------------------------------------------------------------
# Reading a trace


@dataclass
class Gap:
    start_us: float  # from the start of the first profiled step
    length_us: float
    before: str
    after: str


@dataclass
class TraceSummary:
    top_ops: list[tuple[str, float, int]]  # (name, self time in µs, calls), main thread
    gaps: list[Gap]  # host idle stretches on the main thread, in time order
    syncs: dict[str, int]  # sync-like event name -> count, every thread
    wall_us: float  # the profiled steps, end to end, on the main thread
    busy_us: float  # time the main thread spent inside some op
    steps: int = 0  # ProfilerStep#N frames in the trace
    gap_us: float = 50.0

    def __str__(self) -> str:
        per_step = f", {self.steps} steps" if self.steps else ""
        busy = self.busy_us / self.wall_us if self.wall_us else 0.0
        lines = [f"wall {self.wall_us / 1e3:.2f} ms{per_step}; main thread inside ops "
                 f"{self.busy_us / 1e3:.2f} ms ({busy:.0%})", "",
                 f"{'op (main thread)':<44} {'self µs':>11} {'calls':>7}"]
        lines += [f"{name[:44]:<44} {us:>11.1f} {calls:>7}" for name, us, calls in self.top_ops]
        idle = sum(g.length_us for g in self.gaps)
        lines += ["", f"{len(self.gaps)} host gaps >= {self.gap_us:g} µs, {idle / 1e3:.2f} ms in all"]
        for g in sorted(self.gaps, key=lambda g: -g.length_us)[:10]:
            lines.append(f"  at {g.start_us / 1e3:9.3f} ms  {g.length_us:9.1f} µs  {g.before[:30]} -> {g.after[:30]}")
        lines += ["", "syncs: " + (", ".join(f"{n} x{c}" for n, c in sorted(self.syncs.items())) or "none seen")]
        return "\n".join(lines)


def _load(trace: Path | str | dict) -> list[dict]:
    data = trace if isinstance(trace, dict) else json.loads(Path(trace).read_text())
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]


def _is_frame(event: dict) -> bool:
    # The GPU timeline repeats the step frames as "gpu_user_annotation"; the host's are the ones.
    return event.get("cat") == "user_annotation" and event.get("name", "").startswith("ProfilerStep#")


def _main_thread(events: list[dict]):
    steps = Counter((e.get("pid"), e.get("tid")) for e in events if _is_frame(e))
    if steps:
        return steps.most_common(1)[0][0]
    ops = Counter((e.get("pid"), e.get("tid")) for e in events if e.get("cat") == "cpu_op")
    return ops.most_common(1)[0][0] if ops else None


def _is_sync(event: dict) -> bool:
    name = event.get("name", "")
    return name in SYNC_EVENTS or (event.get("cat") == "gpu_memcpy" and "DtoH" in name)


def summarise_trace(trace: Path | str | dict, top: int = 10, gap_us: float = 50.0) -> TraceSummary:
    """What a Chrome trace from ``torch.profiler`` says about the host: see the module docstring."""
    events = _load(trace)
    syncs = Counter(e["name"] for e in events if _is_sync(e))
    main = _main_thread(events)
    mine = sorted((e for e in events if (e.get("pid"), e.get("tid")) == main),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    frames = [e for e in mine if _is_frame(e)]
    work = [e for e in mine if e.get("cat") in _HOST_WORK and not _is_frame(e)]

    # Self time: an event's length less that of the events directly inside it. Runtime calls stay
    # in their op's self time: a wait inside cudaMemcpyAsync belongs to the op that asked for it.
    self_us, calls = defaultdict(float), Counter()
    open_ops: list[tuple[float, str]] = []  # (end, name) of the enclosing ops
    for e in work:
        if e.get("cat") == "cuda_runtime":
            continue
        start, dur = float(e["ts"]), float(e["dur"])
        while open_ops and open_ops[-1][0] <= start:
            open_ops.pop()
        if open_ops:
            self_us[open_ops[-1][1]] -= dur
        self_us[e["name"]] += dur
        calls[e["name"]] += 1
        open_ops.append((start + dur, e["name"]))
    top_ops = sorted(((n, self_us[n], calls[n]) for n in calls), key=lambda r: -r[1])[:top]

    # Top-level work and the holes between its pieces.
    toplevel: list[list] = []  # [start, end, name]
    for e in work:
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if toplevel and start < toplevel[-1][1]:
            toplevel[-1][1] = max(toplevel[-1][1], end)
        else:
            toplevel.append([start, end, e["name"]])
    if frames:
        origin, finish = float(frames[0]["ts"]), max(float(f["ts"]) + float(f["dur"]) for f in frames)
    elif toplevel:
        origin, finish = toplevel[0][0], max(end for _, end, _ in toplevel)
    else:
        origin = finish = 0.0
    gaps = [Gap(a[1] - origin, b[0] - a[1], a[2], b[2]) for a, b in zip(toplevel, toplevel[1:])
            if b[0] - a[1] >= gap_us]
    busy = sum(end - start for start, end, _ in toplevel)
    return TraceSummary(top_ops=top_ops, gaps=gaps, syncs=dict(syncs), wall_us=finish - origin, busy_us=busy,
                        steps=len(frames), gap_us=gap_us)


def timeline(trace: Path | str | dict, gap_us: float = 50.0) -> dict:
    """The main thread's time line, for a plot: ``busy`` (start, length) stretches inside some op,
    ``gaps`` (``Gap``) of at least ``gap_us`` where it ran none, and ``steps``, the start of each
    profiled step; every time in µs from the start of the first step."""
    events = _load(trace)
    main = _main_thread(events)
    mine = sorted((e for e in events if (e.get("pid"), e.get("tid")) == main),
                  key=lambda e: (float(e["ts"]), -float(e["dur"])))
    frames = [e for e in mine if _is_frame(e)]
    stretches: list[list] = []
    for e in mine:
        if e.get("cat") not in _HOST_WORK or _is_frame(e):
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if stretches and start < stretches[-1][1]:
            stretches[-1][1] = max(stretches[-1][1], end)
        else:
            stretches.append([start, end, e["name"]])
    origin = float(frames[0]["ts"]) if frames else (stretches[0][0] if stretches else 0.0)
    return {"busy": [(a - origin, b - a) for a, b, _ in stretches],
            "gaps": [Gap(a[1] - origin, b[0] - a[1], a[2], b[2]) for a, b in zip(stretches, stretches[1:])
                     if b[0] - a[1] >= gap_us],
            "steps": [float(f["ts"]) - origin for f in frames]}


def plot_timeline(trace: Path | str | dict, gap_us: float = 50.0, title: str = ""):
    """The host's time line as bars: inside ops (blue), gaps of at least ``gap_us`` (red), a line
    at the start of each step. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    line = timeline(trace, gap_us)
    fig, ax = plt.subplots(figsize=(9, 1.8))
    ax.broken_barh([(a / 1e3, n / 1e3) for a, n in line["busy"]], (0, 1), color="tab:blue", label="inside an op")
    ax.broken_barh([(g.start_us / 1e3, g.length_us / 1e3) for g in line["gaps"]], (0, 1), color="tab:red",
                   label=f"no op for {gap_us:g} µs or more")
    for start in line["steps"]:
        ax.axvline(start / 1e3, color="black", linewidth=0.8)
    ax.set_yticks([])
    ax.set_xlabel("ms from the first profiled step (black lines: step starts)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=2, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU


def step_flops(fn: Callable[[], object]) -> int:
    """FLOPs of one call of ``fn`` as torch's FLOP counter sees them (backward too, if ``fn`` runs it).

    Only ops with a FLOP formula count (matmuls, convolutions, attention): the useful work MFU is
    defined on, not every elementwise op.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())
