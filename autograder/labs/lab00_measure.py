"""Graded items of lab 00 measure: the roofline calculators with the question they answer (from which
batch a layer is compute-bound), and a timing loop that tells the truth."""

from __future__ import annotations

import math
import random

from autograder.engine.items import Item, LabSpec, Verdict

CALCULATORS = ("matmul_flops", "matmul_bytes", "arithmetic_intensity", "attainable_tflops", "mfu")
# The five one-line calculators are half the item; the reasoning question built on them, the other.
CALCULATOR_SHARE = 0.5


def _batch_case(rng: random.Random, want_none: bool) -> dict:
    """A layer and a machine whose answer is None (no batch reaches the ridge) or a batch of at
    most ten million, drawn away from the integer threshold (and the ridge away from the limit) so
    that any honest float computation rounds the same way."""
    from fastdl_lab.measure import compute_bound_batch_ref

    while True:
        narrow = want_none and rng.random() < 0.5  # a narrow layer, or a machine with a high ridge
        case = {"d_in": rng.randint(16, 1024 if narrow else 16384), "d_out": rng.randint(16, 1024 if narrow else 16384),
                "bytes_per_elem": rng.choice([1, 2, 4]), "peak_tflops": rng.uniform(5, 2000),
                "peak_bw_gbs": rng.uniform(300, 5000)}
        answer = compute_bound_batch_ref(**case)
        if (answer is None) != want_none:
            continue
        ridge = case["peak_tflops"] * 1e3 / case["peak_bw_gbs"]
        e, di, do = case["bytes_per_elem"], case["d_in"], case["d_out"]
        limit = 2 * di * do / ((di + do) * e)
        if abs(limit / ridge - 1) <= 1e-6:
            continue
        if want_none:
            return case
        threshold = ridge * e * di * do / (2 * di * do - ridge * e * (di + do))
        if threshold <= 1e7 and abs(threshold - round(threshold)) > 1e-6:
            return case


def roofline_inputs(seed: int, params: dict) -> dict:
    rng = random.Random(seed)
    cases = []
    for _ in range(int(params.get("cases", 24))):
        cases.append({
            "m": rng.randint(1, 8192), "n": rng.randint(1, 8192), "k": rng.randint(1, 8192),
            "bytes_per_elem": rng.choice([1, 2, 4, 8]),
            "flops": rng.uniform(1e6, 1e15), "bytes_moved": rng.uniform(1e3, 1e12),
            "intensity": 10 ** rng.uniform(-2, 4), "peak_tflops": rng.uniform(5, 1000),
            "peak_bw_gbs": rng.uniform(50, 5000), "achieved_tflops": rng.uniform(0.1, 900),
        })
    n_batch = int(params.get("batch_cases", 8))
    # A quarter of the layers never become compute-bound: an answer that is always a number fails them.
    batch = [_batch_case(rng, want_none=i < n_batch // 4) for i in range(n_batch)]
    rng.shuffle(batch)
    return {"cases": cases, "batch_cases": batch}


def _attempt(ns: dict, name: str, *args):
    """The student's answer as a float (None stays None), or a short text saying why there is
    none, for the verdict: one broken function costs its own share, not the whole item."""
    if name not in ns:
        return "nothing (not defined)"
    try:
        value = ns[name](*args)
    except Exception as exc:  # noqa: BLE001 - whatever the student's function raises is its answer
        return f"an error ({type(exc).__name__}: {str(exc)[:100]})"
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return f"a {type(value).__name__}"


def _call_all(ns: dict, c: dict) -> list:
    return [
        _attempt(ns, "matmul_flops", c["m"], c["n"], c["k"]),
        _attempt(ns, "matmul_bytes", c["m"], c["n"], c["k"], c["bytes_per_elem"]),
        _attempt(ns, "arithmetic_intensity", c["flops"], c["bytes_moved"]),
        _attempt(ns, "attainable_tflops", c["intensity"], c["peak_tflops"], c["peak_bw_gbs"]),
        _attempt(ns, "mfu", c["achieved_tflops"], c["peak_tflops"]),
    ]


def roofline_drive(ns: dict, inputs: dict) -> dict:
    return {"calculators": [_call_all(ns, c) for c in inputs["cases"]],
            "batches": [_attempt(ns, "compute_bound_batch", c["d_in"], c["d_out"], c["bytes_per_elem"],
                                 c["peak_tflops"], c["peak_bw_gbs"]) for c in inputs["batch_cases"]]}


def _expected(c: dict) -> list[float]:
    from fastdl_lab import measure

    return [
        measure.matmul_flops_ref(c["m"], c["n"], c["k"]),
        measure.matmul_bytes_ref(c["m"], c["n"], c["k"], c["bytes_per_elem"]),
        measure.arithmetic_intensity_ref(c["flops"], c["bytes_moved"]),
        measure.attainable_tflops_ref(c["intensity"], c["peak_tflops"], c["peak_bw_gbs"]),
        measure.mfu_ref(c["achieved_tflops"], c["peak_tflops"]),
    ]


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _calculators_wrong(inputs: dict, outputs: list) -> dict[str, str]:
    wrong: dict[str, str] = {}
    for c, got in zip(inputs["cases"], outputs, strict=True):
        for name, g, e in zip(CALCULATORS, got, _expected(c), strict=True):
            if name not in wrong and not (isinstance(g, float) and math.isclose(g, e, rel_tol=1e-6)):
                args = {k: c[k] for k in ("m", "n", "k", "bytes_per_elem")} if name.startswith("matmul") else None
                wrong[name] = f"{name} gave {_shown(g)}, expected {e:.6g}" + (f" for {args}" if args else "")
    return wrong


def _batches_scored(inputs: dict, answers: list) -> tuple[int, list[str], str]:
    """How many hidden layers earn credit, what was wrong, and why right answers earned nothing.
    "No batch" is the answer of a quarter of the layers, and a function that always says so has
    found none: those answers count only beside at least one batch found right."""
    from fastdl_lab.measure import compute_bound_batch_ref

    wrong, right_none, right_batch = [], 0, 0
    for c, got in zip(inputs["batch_cases"], answers, strict=True):
        expected = compute_bound_batch_ref(**c)
        if got is None and expected is None:
            right_none += 1
            continue
        if isinstance(got, float) and got == expected:
            right_batch += 1
            continue
        args = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items())
        wrong.append(f"compute_bound_batch({args}) gave {_shown(got)}, expected {expected}")
    if not right_batch and right_none:
        return 0, wrong, (f"None on the {right_none} layers with no compute-bound batch earns nothing while "
                          "no batch is found right")
    return right_batch + right_none, wrong, ""


def roofline_check(inputs: dict, outputs, params: dict) -> Verdict:
    calculators, batches = outputs["calculators"], outputs["batches"]
    wrong = _calculators_wrong(inputs, calculators)
    credited, missed, unearned = _batches_scored(inputs, batches)
    right, n_batch = len(CALCULATORS) - len(wrong), len(inputs["batch_cases"])
    fraction = CALCULATOR_SHARE * right / len(CALCULATORS) + (1 - CALCULATOR_SHARE) * credited / n_batch
    summary = (f"{right}/{len(CALCULATORS)} calculators correct on {len(inputs['cases'])} hidden cases; "
               f"compute_bound_batch credited on {credited}/{n_batch} hidden layers")
    problems = list(wrong.values()) + missed[:1] + ([unearned] if unearned else [])
    return Verdict(fraction, summary + ("; " + "; ".join(problems) if problems else ""))


def timing_inputs(seed: int, params: dict) -> dict:
    """The op's length and the loop's counts, drawn per student: a loop that hard-codes the
    notebook's counts launches the wrong number of ops."""
    rng = random.Random(seed)
    op = float(params.get("op_seconds", 0.02)) * rng.uniform(0.8, 1.25)
    iters = int(params.get("iters", 6))
    return {"op_seconds": op, "compile_seconds": float(params.get("compile_seconds", 0.4)),
            "iters": rng.randint(iters, iters + 2), "warmup": rng.randint(1, 3)}


def timing_services(inputs: dict, params: dict) -> dict:
    from autograder.labs._simulated_device import SERVICE, DeviceService

    return {SERVICE: DeviceService(inputs["op_seconds"], inputs["compile_seconds"])}


def timing_drive(ns: dict, inputs: dict) -> list[float]:
    # The device is the grader's (DeviceService); the student's loop holds a handle on it.
    from autograder.labs._simulated_device import RemoteDevice

    with RemoteDevice() as dev:
        return [float(s) for s in ns["time_op"](dev, iters=inputs["iters"], warmup=inputs["warmup"])]


# Seconds by which a sample may leave the window the grader's record allows it: the child's clock
# and the grader's are the same kernel clock, read a few function calls apart.
SAMPLE_SLACK_S = 0.002
WAITS = ("synchronize", "result")


def _loop_problem(events: list, warmup: int, iters: int) -> tuple[str, list[tuple[int, int, int, int]]]:
    """What is wrong with the loop the device saw (``events`` end with the drive's close), or "" and,
    per timed launch, the indices of the last launch or wait before it, itself, the first wait after
    it, and the next launch (or the close): the sample's timer ran inside the last pair."""
    launches = [i for i, (call, _, _) in enumerate(events) if call == "launch"]
    if len(launches) != warmup + iters:
        plural = "" if len(launches) == 1 else "es"
        return (f"the device saw {len(launches)} launch{plural}; warmup={warmup} and iters={iters} make "
                f"{warmup + iters}"), []
    waits = [i for i, (call, _, _) in enumerate(events) if call in WAITS]
    if warmup and not any(launches[warmup - 1] < w < launches[warmup] for w in waits):
        return ("the first timed launch was queued behind the warm-up launches: wait for the warm-up "
                "to finish before starting the timer"), []
    # The drive's close (the last event) comes after time_op returned, so after the last timer stopped.
    ends = launches + [len(events) - 1]
    timed = []
    for j, k in enumerate(launches[warmup:]):
        nxt = ends[warmup + j + 1]
        after = [w for w in waits if k < w < nxt]
        if not after:
            return (f"timed launch {j + 1} of {iters} was never waited for (no synchronize before the "
                    "next launch): the loop times the launch, not the work"), []
        before = max(i for i in launches + waits if i < k)
        timed.append((before, k, after[0], nxt))
    return "", timed


def _sample_problem(samples: list[float], events: list, timed: list, op: float, compile_s: float) -> str:
    for j, (s, (before, launch, wait, nxt)) in enumerate(zip(samples, timed, strict=True)):
        inside = events[wait][2] - events[launch][1]  # from the launch's arrival to the wait's answer
        around = events[nxt][1] - events[before][2]
        if s < inside - SAMPLE_SLACK_S:
            return (f"sample {j + 1} is {s * 1e3:.2f} ms, but the grader's device took {inside * 1e3:.2f} ms "
                    "from that launch to its synchronize: the samples are not the loop's measurements")
        if s > around + SAMPLE_SLACK_S:
            return (f"sample {j + 1} is {s * 1e3:.2f} ms, longer than the {around * 1e3:.2f} ms between the "
                    "device calls around it: the samples are not the loop's measurements")
    if max(samples) > op + 0.5 * compile_s:
        return (f"a sample of {max(samples) * 1e3:.0f} ms for a {op * 1e3:.1f} ms op: the timed region holds "
                "more than one launch and its synchronize")
    return ""


def timing_check(inputs: dict, samples, params: dict, observed) -> Verdict:
    """Judged on the grader's record of the device (``DeviceService``): the launches, the waits and
    the intervals between them on the grader's clock. The samples the child returns must be ones
    that record explains; they are never believed on their own."""
    op, compile_s = inputs["op_seconds"], inputs["compile_seconds"]
    iters, warmup = inputs["iters"], inputs["warmup"]
    record = observed.services.get("device") or {}
    events = record.get("events", [])
    closed = next((i for i, (call, _, _) in enumerate(events) if call == "close"), None)
    if closed is None:
        return Verdict.failed("the grader's device was never closed by the grader's runner: the samples did not "
                              "come back from time_op through it")
    events = events[:closed + 1]  # what came after time_op returned is not its loop
    if not isinstance(samples, list) or len(samples) != iters or not all(
            isinstance(s, float) and math.isfinite(s) for s in samples):
        return Verdict.failed(f"time_op must return {iters} numbers for iters={iters}")
    problem, timed = _loop_problem(events, warmup, iters)
    if not problem:
        problem = _sample_problem(samples, events, timed, op, compile_s)
    if problem:
        return Verdict.failed(problem, samples=samples)
    return Verdict.passed(
        f"median {sorted(samples)[iters // 2] * 1e3:.1f} ms for a {op * 1e3:.1f} ms op; the grader's device saw "
        f"{warmup} warm-up launches past the {compile_s * 1e3:.0f} ms compilation, then {iters} timed launches, "
        "each waited for", samples=samples)


LAB = LabSpec(
    name="00_measure",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("roofline", 4, ("roofline_code",), roofline_inputs, roofline_drive, roofline_check,
             kind="correctness",
             description="FLOPs, bytes, intensity, attainable FLOP/s and MFU; the batch from which a layer is compute-bound"),
        Item("timing", 3, ("timing_code",), timing_inputs, timing_drive, timing_check,
             kind="mechanism", services=timing_services, withheld=("op_seconds", "compile_seconds"),
             description="per-iteration time of an asynchronous op, warmed up and synced (on the grader's device)"),
    ],
)
