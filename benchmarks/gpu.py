"""The GPU run of the course, in one command (make bench-gpu): tests, benchmarks, a threshold proposal.

On a GPU host, within a budget of ten minutes:

1. the GPU tests: the ``gpu``-marked ones and the kernel tests, which pick the GPU when there is one
   (when pytest is installed; a GPU image may lack it, which is said);
2. the GPU spec of every technique benchmark (``benchmarks/<name>.py``: rows with hardware
   columns in ``benchmarks/results/<name>.csv``), the labs' headline kernels first, as many as the
   budget leaves time for (on an H200 all of them take more than one budget);
3. a calibration of the speed thresholds of this GPU's grading profile: every speed item of the
   profile graded on the instructor's reference solution, several times, and a proposed
   ``min_speedup`` a stated margin below the median speedup, written to
   ``benchmarks/results/calibration_<profile>.json`` for a person to review; the profile itself
   is never changed here.

Each step appends a row to ``benchmarks/results/gpu_runs.csv`` with the GPU's name, driver and
clocks at that moment (a throttled GPU shows there). On a CPU host it says that a GPU is needed
and exits 0; on a GPU host that cannot run compiled kernels it says what is missing and exits 1.

Runs from the source tree with only torch, Triton and NumPy installed (``PYTHONPATH=.``): the
labs whose grading needs more (pandas for lab 08, ...) are reported as not calibrated.

    PYTHONPATH=. python3 benchmarks/gpu.py [--budget 570] [--runs 3] [--margin 0.4] [--skip tests,benchmarks]
                                           [--benchmarks layernorm,optim]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import importlib.util
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Each step's whole output, for reading after a run (not committed).
LOGS = ROOT / "build" / "bench-gpu"
# The labs' headline kernels (the figures the course promises) run first, so a short budget
# measures them before anything else.
BENCHMARK_ORDER = ["gemm", "attention", "softmax", "layernorm", "measure", "optim", "quant", "fusion",
                   "amp", "custom", "data", "distributed", "tabular"]
STEPS = ("tests", "calibration", "benchmarks")
# A proposal the grader can live with: the reference's median speedup times (1 - margin). The
# students' kernels may be simpler than the reference and other GPUs of the same profile slower,
# so the margin is wide; it is stated in the proposal.
DEFAULT_MARGIN = 0.4
# Speedups of one item spread wider than this (max / min over the runs) are flagged as noisy.
NOISY_SPREAD = 1.15
NVIDIA_SMI_FIELDS = ["name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
                     "power.limit", "temperature.gpu", "pstate"]


# --------------------------------------------------------------------------------------------
# Pure arithmetic and parsing (unit-tested on the CPU with made-up inputs)


def parse_gpu_state(csv_line: str) -> dict[str, str]:
    """One line of ``nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits``."""
    values = [v.strip() for v in next(csv.reader([csv_line]))]
    if len(values) != len(NVIDIA_SMI_FIELDS):
        raise ValueError(f"nvidia-smi gave {len(values)} fields, expected {len(NVIDIA_SMI_FIELDS)}: {csv_line!r}")
    return {"gpu_" + field.replace(".", "_"): value for field, value in zip(NVIDIA_SMI_FIELDS, values)}


def propose_threshold(speedups: list[float], margin: float = DEFAULT_MARGIN) -> dict[str, object]:
    """A ``min_speedup`` for one speed item from the reference's measured speedups over the baseline.

    The median resists one disturbed run; the proposal is ``median * (1 - margin)`` rounded
    *down* to two decimals, so the reference always clears it by at least the margin.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if not speedups or any(not (s > 0 and math.isfinite(s)) for s in speedups):
        raise ValueError(f"speedups must be positive finite numbers, got {speedups}")
    mid = median(speedups)
    spread = max(speedups) / min(speedups)
    # Rounded first so that 0.7 x 0.6 is 0.42, not the 0.41 of 41.99999999999999.
    proposed = math.floor(round(mid * (1 - margin) * 100, 6)) / 100
    proposal = {"speedups": [round(s, 4) for s in speedups], "median": round(mid, 4),
                "spread": round(spread, 4), "noisy": spread > NOISY_SPREAD, "proposed_min_speedup": proposed}
    if proposed <= 0:
        proposal["note"] = "the reference is too slow against the baseline for a threshold: keep the current one"
    return proposal


def calibration_proposal(profile: dict, measured: dict[tuple[str, str], list[float]],
                         unmeasured: dict[tuple[str, str], str], margin: float) -> dict[str, object]:
    """The proposal file's content: per speed item of ``profile``, its current threshold, what
    the reference measured and the proposed threshold, or why there is none."""
    items: dict[str, dict[str, dict]] = {}
    for lab, lab_items in profile.get("labs", {}).items():
        for item, params in lab_items.items():
            if "min_speedup" not in params:
                continue
            entry: dict[str, object] = {"current_min_speedup": params["min_speedup"]}
            key = (lab, item)
            if measured.get(key):
                entry.update(propose_threshold(measured[key], margin))
            else:
                entry["not_calibrated"] = unmeasured.get(key, "not measured")
            items.setdefault(lab, {})[item] = entry
    return {"profile": profile.get("name"), "margin": margin,
            "rule": f"proposed_min_speedup = floor(median reference speedup x {1 - margin:g}, 2 decimals)",
            "items": items}


# --------------------------------------------------------------------------------------------
# The host


def gpu_state() -> dict[str, str]:
    argv = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout
        return parse_gpu_state(out.splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        # Every column present, so that gpu_runs.csv keeps one header.
        return {**parse_gpu_state(",".join([""] * len(NVIDIA_SMI_FIELDS))),
                "gpu_name": f"unknown (nvidia-smi: {type(exc).__name__})"}


def record_step(step: str, status: str, seconds: float, detail: str = "") -> None:
    row = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **gpu_state(),
           "step": step, "status": status, "seconds": round(seconds, 1), "detail": detail[:300]}
    path = RESULTS / "gpu_runs.csv"
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)
    print(f"[{step}] {status} in {seconds:.0f} s {detail}", flush=True)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _child_env() -> dict[str, str]:
    # The children import the package from this source tree, whatever is installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    return env


def _run(argv: list[str], timeout: float, log: Path) -> tuple[str, str]:
    """Run a step's process with its own deadline; (status, last lines of its output). The whole
    output goes to ``log``: a failing test's traceback is rarely in the last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(argv, cwd=ROOT, env=_child_env(), capture_output=True, text=True,
                              timeout=max(1.0, timeout), start_new_session=True)
        status, output = ("ok" if done.returncode == 0 else f"exit {done.returncode}"), done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        status, output = "timeout", "".join(s.decode(errors="replace") if isinstance(s, bytes) else s
                                            for s in (exc.stdout, exc.stderr) if s)
    log.write_text(output)
    return status, output[-4000:]


# --------------------------------------------------------------------------------------------
# Steps


# A test file runs on the GPU when it is marked ``gpu`` or picks its device by whether there is one
# (the kernel tests: the same cases as under the interpreter, compiled for this GPU).
_GPU_TEST = re.compile(r'mark\.gpu\b|"cuda" if device\.has_gpu\(\)')


def gpu_test_files(tests: Path = ROOT / "tests") -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in tests.glob("test_*.py") if _GPU_TEST.search(p.read_text()))


def run_tests(budget: Budget) -> None:
    started = time.monotonic()
    if importlib.util.find_spec("pytest") is None:
        record_step("tests", "skipped", 0, "pytest is not installed here: the GPU tests were not run")
        return
    files = gpu_test_files()
    if not files:
        record_step("tests", "skipped", 0, "no GPU tests")
        return
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    argv = [sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "-p", "no:benchmark", *workers,
            *files]
    status, output = _run(argv, min(180, budget.left()), LOGS / "tests.log")
    print(output)
    record_step("tests", status, time.monotonic() - started, output.strip().splitlines()[-1] if output.strip() else "")


def run_benchmarks(budget: Budget, names: list[str]) -> None:
    for name in names:
        left = budget.left()
        if left < 20:
            record_step(f"benchmark {name}", "skipped", 0, "out of time budget")
            continue
        started = time.monotonic()
        status, output = _run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py")], min(120, left),
                               LOGS / f"benchmark-{name}.log")
        if status != "ok":
            print(output)
        last = output.strip().splitlines()[-1] if output.strip() else ""
        record_step(f"benchmark {name}", status, time.monotonic() - started, last)


def technique_benchmarks() -> list[str]:
    """Every ``benchmarks/<name>.py`` that runs a technique's spec through ``_runner``, headline first."""
    found = {p.stem for p in (ROOT / "benchmarks").glob("*.py")
             if not p.stem.startswith("_") and re.search(r"^from _runner import", p.read_text(), re.M)}
    return [n for n in BENCHMARK_ORDER if n in found] + sorted(found - set(BENCHMARK_ORDER))


_CELL = re.compile(r"^# %%.*?nbgrader=(\{.*\})\s*$")


def reference_cells(lab_source: Path) -> dict[str, str]:
    """The solution cells of a jupytext lab, markers removed, read without jupytext: grade_id -> code."""
    from autograder import strip
    cells: dict[str, list[str]] = {}
    current = None
    for line in lab_source.read_text().splitlines():
        if line.startswith("# %%"):
            match = _CELL.match(line)
            meta = json.loads(match.group(1)) if match else {}
            current = meta["grade_id"] if meta.get("solution") else None
            if current:
                cells[current] = []
        elif current is not None and line.strip() not in (strip.BEGIN, strip.END):
            cells[current].append(line)
    return {k: "\n".join(v).strip() + "\n" for k, v in cells.items()}


def _lab_specs() -> tuple[dict, dict[str, str]]:
    """The labs whose grading specs import here, and why the others do not."""
    import autograder.labs as pkg

    specs, missing = {}, {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("lab"):
            continue
        try:
            spec = importlib.import_module(f"autograder.labs.{info.name}").LAB
        except ImportError as exc:
            missing[info.name] = f"its grading spec needs {exc.name or exc}"
            continue
        specs[spec.name] = spec
    return specs, missing


def calibrate(budget: Budget, runs: int, margin: float, profile: dict | None = None,
              results: Path = RESULTS) -> Path:
    """Grade every speed item of ``profile`` (this GPU's by default) on the reference ``runs``
    times and write the proposal to ``results/calibration_<profile>.json``."""
    from autograder import profiles
    from autograder.engine import grade
    from fastdl_lab import device

    started = time.monotonic()
    profile = profile or profiles.load(device.profile_name())
    # The instructor's reference is trusted code: its children run without bubblewrap (below), which
    # a GPU image may lack; the timing itself is the graded one (same child, same fastdl_lab.timing).
    specs, broken = _lab_specs()
    measured: dict[tuple[str, str], list[float]] = {}
    unmeasured: dict[tuple[str, str], str] = {}
    todo = []  # (lab spec, item, reference cells) of every speed item that can be graded here
    for lab_name, lab_items in profile.get("labs", {}).items():
        speed = [name for name, params in lab_items.items() if "min_speedup" in params]
        spec = specs.get(lab_name)
        if spec is None:
            why = next((w for m, w in broken.items() if m == f"lab{lab_name}"), "no grading spec")
            unmeasured.update({(lab_name, name): why for name in speed})
            continue
        cells = reference_cells(ROOT / "labs" / f"{lab_name}.py")
        todo += [(spec, item, cells) for item in spec.items if item.name in speed]
    # Round by round, so that a short budget still measures every item once before any twice.
    for run in range(runs):
        for spec, item, cells in todo:
            key = (spec.name, item.name)
            if key in unmeasured:
                continue
            if budget.left() < 30:
                if not measured.get(key):
                    unmeasured[key] = "out of time budget"
                continue
            limits = {**profile["limits"], "wall_s": max(10, min(profile["limits"]["wall_s"], int(budget.left()) - 10))}
            result = grade._grade_item(spec, item, cells, run, grade.Sandbox(ROOT, {**profile, "limits": limits},
                                                                               isolated=False))
            speedup = result.details.get("speedup")
            if speedup is None:
                unmeasured[key] = f"{result.status}: {result.reason}"[:300]
                measured.pop(key, None)
                continue
            measured.setdefault(key, []).append(float(speedup))
            print(f"  {spec.name}/{item.name} run {run + 1}: reference {speedup:.3f}x the baseline", flush=True)
    proposal = calibration_proposal(profile, measured, unmeasured, margin)
    info = device.info()
    proposal["measured_on"] = {**gpu_state(), "torch": info.torch_version, "triton": info.triton_version,
                               "cuda": info.cuda_version, "runs": runs,
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path = results / f"calibration_{profile['name']}.json"
    path.write_text(json.dumps(proposal, indent=2) + "\n")
    print(f"[calibration] {len(measured)} speed items measured in {time.monotonic() - started:.0f} s; "
          f"proposal in {path}", flush=True)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole run (default 570)")
    parser.add_argument("--runs", type=int, default=3, help="gradings of each speed item (default 3)")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"proposed threshold = median x (1 - margin) (default {DEFAULT_MARGIN})")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to leave out: {', '.join(STEPS)}")
    parser.add_argument("--benchmarks", default="", help="comma-separated benchmarks to run (default: all, "
                        "headline kernels first)")
    args = parser.parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    known = technique_benchmarks()
    chosen = [b for b in args.benchmarks.split(",") if b] or known
    if skip - set(STEPS) or args.runs < 1 or not 0 <= args.margin < 1 or set(chosen) - set(known):
        parser.error(f"--skip takes {', '.join(STEPS)}; --benchmarks takes {', '.join(known)}; --runs at least 1; "
                     "--margin in [0, 1)")

    from fastdl_lab import device

    problems = device.host_problems(device.host_facts())
    if not device.has_gpu():
        if problems:
            print("make bench-gpu: this host has an NVIDIA driver but cannot use the GPU:\n  " + "\n  ".join(problems))
            return 1
        print("make bench-gpu needs a GPU: this host has none, so there is nothing to measure (run it on a GPU "
              "host; the CPU path is covered by make test).")
        return 0
    if problems:
        print("make bench-gpu: this GPU host cannot run compiled Triton kernels yet:\n  " + "\n  ".join(problems))
        return 1
    print(device.describe(), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    if "tests" not in skip:
        run_tests(budget)
    if "calibration" not in skip:
        # Half of what is left at most, so the benchmarks' figures get measured too.
        started = time.monotonic()
        path = calibrate(Budget(budget.left() / 2 if "benchmarks" not in skip else budget.left()), args.runs,
                         args.margin)
        items = json.loads(path.read_text())["items"]
        done = sum("median" in entry for lab in items.values() for entry in lab.values())
        record_step("calibration", "ok" if done else "nothing measured", time.monotonic() - started,
                    f"{done} speed items measured; proposal in {path.relative_to(ROOT)}")
    if "benchmarks" not in skip:
        run_benchmarks(budget, chosen)
    print("rows in benchmarks/results/ (gpu_runs.csv has the GPU's clocks per step); review the proposal before "
          "copying any threshold into autograder/profiles/.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
