"""Graded items of lab 08 rapids: an ETL pipeline written once for pandas and cuDF, a vectorised
feature against the row loop, an ML step judged on labels it never sees, and GPU speed items.

The student's functions are extracted and screened (``Item.artefacts``): nothing else of the
notebook runs in the grading child. The tables are regenerated in the child from the hidden seed
by the package's generator (DataFrames do not travel through ``inputs.pt``), the test labels stay
in the parent, and the row-loop race is timed by trusted code on a different table per call, so a
function cannot answer from a cache.
"""

from __future__ import annotations

import math
from statistics import median

import numpy as np

from autograder.engine.items import Clocked, Item, LabSpec, Verdict

SCOPE = "import math\nimport numpy as np\nfrom fastdl_lab.tabular import day_of_week\n"


def _trips(inputs: dict):
    from fastdl_lab import tabular

    return tabular.make_trips(int(inputs["rows"]), seed=int(inputs["seed"]))


def _plain(frame) -> dict:
    """A table as lists of plain values: what ``inputs.pt``/``outputs.pt`` can carry."""
    from fastdl_lab import tabular

    frame = tabular.to_pandas(frame)
    out = {}
    for column in frame.columns:
        values = frame[column].astype(object).where(frame[column].notna(), None).tolist()
        out[str(column)] = [v.item() if hasattr(v, "item") else v for v in values]
    return out


def _frame(columns: dict):
    import pandas as pd

    if not isinstance(columns, dict) or not all(isinstance(v, list) for v in columns.values()):
        raise AssertionError(f"expected a table, got {type(columns).__name__}")
    return pd.DataFrame({str(k): v for k, v in columns.items()})


def _seeded(seed: int, params: dict, default: int = 5000) -> dict:
    return {"rows": int(params.get("rows", default)), "seed": seed % (1 << 31)}


# --- ETL --------------------------------------------------------------------------------------


def etl_drive(ns: dict, inputs: dict) -> dict:
    from fastdl_lab import tabular

    be = tabular.backend("auto")
    trips, zones = _trips(inputs)
    if be.gpu:
        trips, zones = be.df.from_pandas(trips), be.df.from_pandas(zones)
    return {"table": _plain(ns["etl"](trips, zones)), "backend": be.name}


def etl_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import tabular

    trips, zones = _trips(inputs)
    want = tabular.etl_ref(trips, zones)
    try:
        got = _frame(outputs["table"])
        tabular.compare_tables(got, want, tabular.KEYS)
    except AssertionError as exc:
        return Verdict.failed(f"on {inputs['rows']} hidden trips ({outputs.get('backend')}): {str(exc)[:500]}")
    return Verdict.passed(f"the {len(want)}-row summary of {inputs['rows']} hidden trips matches the reference "
                          f"({outputs['backend']})")


# --- vectorised vs the row loop ----------------------------------------------------------------


def vectorised_inputs(seed: int, params: dict) -> dict:
    return _seeded(seed, params, default=6000)


def vectorised_call(seed: int, params: dict, i: int) -> dict:
    """The ``i``-th timed call's fares and distances, drawn here and sent with the call: no call's
    answer can be known before it arrives, from a cache or from a scaled earlier answer."""
    rng = np.random.default_rng([seed % (1 << 31), i])
    n = int(params.get("rows", 6000))
    distance = rng.lognormal(np.log(3.0), 0.75, n)
    distance[rng.random(n) < 0.02] = 0.0
    return {"fare": np.round(rng.uniform(3.0, 80.0, n), 2), "distance_km": distance}


def _with_call(trips, args: dict):
    return trips.assign(fare=np.asarray(args["fare"]), distance_km=np.asarray(args["distance_km"]))


def vectorised_candidate(ns: dict, inputs: dict):
    from fastdl_lab import tabular

    trips, _ = _trips(inputs)
    student = ns["fare_per_km"]
    return lambda args: np.asarray(tabular.to_numpy(student(_with_call(trips, args))), dtype=np.float64)


def vectorised_baseline(_ns: dict, inputs: dict):
    from fastdl_lab import tabular

    trips, _ = _trips(inputs)
    return lambda args: tabular.fare_per_km_loop(_with_call(trips, args)).to_numpy(dtype=np.float64)


def vectorised_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    timings = observed.timings
    candidate, baseline = timings["candidate"], timings["baseline"]
    for i, (got, want) in enumerate(zip(candidate, baseline, strict=True)):
        want = np.asarray(want, dtype=float)
        got = np.asarray(got, dtype=float) if isinstance(got, np.ndarray) else np.array([], dtype=float)
        if got.shape != want.shape:
            return Verdict.failed(f"fare_per_km returned {got.size} values for {want.size} trips (timed call {i})")
        close = np.isclose(got, want, rtol=1e-6, atol=1e-9, equal_nan=True)
        if not close.all():
            row = int(np.argmin(close))
            return Verdict.failed(f"{int((~close).sum())} of {want.size} values differ from the row loop's in timed "
                                  f"call {i}; first at row {row}: {got[row]!r} instead of {want[row]!r}")
    speedup = median(timings["baseline_s"]) / median(timings["candidate_s"])
    target = float(params.get("min_speedup", 20.0))
    details = {"speedup": speedup, "candidate_s": timings["candidate_s"], "baseline_s": timings["baseline_s"]}
    clock = (f"{speedup:.0f}x faster than the row loop on the grader's clock, {len(candidate)} calls each on "
             "tables no call had seen")
    if speedup < target:
        return Verdict(0.5, f"right values, but only {clock.replace(f'{speedup:.0f}x', f'{speedup:.1f}x')} "
                            f"(needs {target:.0f}x): is there still a Python loop over the rows?", details)
    return Verdict.passed(f"same values as the row loop, {clock} (needs {target:.0f}x)", **details)


# --- ML ---------------------------------------------------------------------------------------


def _split(inputs: dict):
    from fastdl_lab import tabular

    trips, _ = _trips(inputs)
    X, y = tabular.features(trips, tabular.backend("cpu"))
    X, y = X.to_numpy(), y.to_numpy()
    n_train = int(len(y) * 0.75)
    order = np.random.default_rng(int(inputs["seed"])).permutation(len(y))
    train, test = order[:n_train], order[n_train:]
    return X[train], y[train], X[test], y[test]


def ml_drive(ns: dict, inputs: dict) -> dict:
    from fastdl_lab import tabular

    be = tabular.backend("auto")
    X_train, y_train, X_test, _ = _split(inputs)
    # The test labels stay here, in trusted code's frame, and are never handed to the function.
    pred = ns["fit_predict"](X_train, y_train, X_test, be.ml)
    return {"pred": [int(v) for v in tabular.to_numpy(pred).reshape(-1).tolist()], "backend": be.name}


def ml_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import tabular

    X_train, y_train, X_test, y_test = _split(inputs)
    pred = np.asarray(outputs["pred"], dtype=np.int64)
    if pred.shape != y_test.shape:
        return Verdict.failed(f"{pred.size} predictions for {y_test.size} test rows")
    reference = tabular.ml_ref(X_train, y_train, X_test, tabular.backend("cpu"))
    best = max(tabular.accuracy(p, y_test) for name, p in reference.items() if name != "kmeans")
    majority = max(float(np.mean(y_test)), 1 - float(np.mean(y_test)))
    accuracy, slack = tabular.accuracy(pred, y_test), float(params.get("slack", 0.03))
    details = {"accuracy": accuracy, "reference": best, "majority": majority}
    if accuracy >= best - slack:
        return Verdict.passed(f"accuracy {accuracy:.3f} on hidden test labels (reference {best:.3f})", **details)
    if accuracy > majority + 0.01:
        return Verdict(0.5, f"accuracy {accuracy:.3f}: better than always guessing the majority ({majority:.3f}) "
                            f"but more than {slack:.2f} below the reference's {best:.3f}", details)
    return Verdict.failed(f"accuracy {accuracy:.3f}, no better than always guessing the majority ({majority:.3f})",
                          **details)


# --- speed (GPU profiles) ---------------------------------------------------------------------


def _needs_rapids():
    from autograder.engine.faults import MachineLacks
    from fastdl_lab import tabular

    be = tabular.backend("auto")
    if not be.gpu:
        # The machine's lack, not the student's: the item is not graded, and says why.
        raise MachineLacks(f"needs RAPIDS on this GPU host: {be.reason}")
    return be


def etl_speed_timed(ns: dict, inputs: dict):
    be = _needs_rapids()
    trips, zones = _trips(inputs)
    trips, zones = be.df.from_pandas(trips), be.df.from_pandas(zones)
    return lambda: {"table": _plain(ns["etl"](trips, zones)), "backend": be.name}


def etl_speed_baseline(ns: dict, inputs: dict):
    # The same function on pandas: the lab's point is one pipeline, two backends.
    trips, zones = _trips(inputs)
    return lambda: ns["etl"](trips, zones)


def ml_speed_timed(ns: dict, inputs: dict):
    from fastdl_lab import tabular

    be = _needs_rapids()
    X_train, y_train, X_test, _ = _split(inputs)

    def run():
        pred = ns["fit_predict"](X_train, y_train, X_test, be.ml)
        return {"pred": [int(v) for v in tabular.to_numpy(pred).reshape(-1).tolist()], "backend": be.name}

    return run


def ml_speed_baseline(ns: dict, inputs: dict):
    from fastdl_lab import tabular

    X_train, y_train, X_test, _ = _split(inputs)
    cpu = tabular.backend("cpu")
    return lambda: ns["fit_predict"](X_train, y_train, X_test, cpu.ml)


def ml_speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return ml_check(inputs, outputs, {**params, "slack": params.get("slack", 0.05)})


LAB = LabSpec(
    name="08_rapids",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("etl_pipeline", 4, ("etl_code",), _seeded, etl_drive, etl_check, artefacts=("etl",), scope=SCOPE,
             description="clean, join, feature and aggregate hidden trips: the same table as the reference"),
        Item("vectorised", 2, ("vectorised_code",), vectorised_inputs, check=vectorised_check,
             kind="mechanism", artefacts=("fare_per_km",), scope=SCOPE, reference=lambda inputs: {},
             clocked=Clocked(vectorised_call, vectorised_candidate, vectorised_baseline, warmup=1, reps=5),
             description="a vectorised column against the row loop: same values, a ratio timed call by call "
                         "on the grader's clock"),
        Item("ml_predictions", 3, ("ml_code",), _seeded, ml_drive, ml_check, artefacts=("fit_predict",), scope=SCOPE,
             description="predictions judged on hidden test labels the function never sees"),
        Item("etl_gpu_speed", 2, ("etl_code",), _seeded, kind="speed", check=etl_check, timed=etl_speed_timed,
             baseline=etl_speed_baseline, artefacts=("etl",), scope=SCOPE,
             description="your pipeline on cuDF vs the reference on pandas (GPU profiles)"),
        Item("ml_gpu_speed", 2, ("ml_code",), _seeded, kind="speed", check=ml_speed_check, timed=ml_speed_timed,
             baseline=ml_speed_baseline, artefacts=("fit_predict",), scope=SCOPE,
             description="your ML step on cuML vs scikit-learn (GPU profiles)"),
    ],
)
