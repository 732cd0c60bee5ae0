"""Graded items of lab 08 rapids: an ETL pipeline written once for pandas and cuDF, a vectorised
feature against the row loop, an ML step judged on labels it never sees, and GPU speed items.

The student's functions are extracted and screened (``Item.artefacts``): nothing else of the
notebook runs in the grading child. What a child needs travels as data: the ETL's trips and zones
as columns (``table_columns``), the ML step's training rows, labels and test rows as arrays. The
seed the data came from and the test labels stay in the parent (``Item.withheld``), which computes
every reference itself. Speed is taken on the grader's clock, call by call, against the course's
own code in a reference child, each call on columns or rows drawn in the parent for that call
(``Item.clocked``), so that neither a cache nor an earlier answer can serve it.
"""

from __future__ import annotations

from statistics import median

import numpy as np

from autograder.engine.items import Clocked, Item, LabSpec, Verdict
from autograder.labs._common import clocked_speed

SCOPE = "import math\nimport numpy as np\nfrom fastdl_lab.tabular import day_of_week\n"


def _trips(inputs: dict):
    from fastdl_lab import tabular

    return tabular.make_trips(int(inputs["rows"]), seed=int(inputs["seed"]))


def _plain(frame) -> dict:
    """A table as lists of plain values: what the data-only format carries."""
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


# --- tables as data -------------------------------------------------------------------------------


def table_columns(frame) -> dict:
    """A pandas table as the data-only format carries it, column by column: numbers as arrays,
    datetimes as nanoseconds, nullable integers as values and a mask, text as codes and labels
    (a million strings would be a million JSON strings; their few distinct labels are not)."""
    import pandas as pd

    columns = {}
    for name in frame.columns:
        column = frame[name]
        if pd.api.types.is_datetime64_any_dtype(column):
            columns[str(name)] = {"kind": "datetime", "ns": column.astype("datetime64[ns]").to_numpy().view(np.int64)}
        elif isinstance(column.dtype, pd.Int64Dtype):
            columns[str(name)] = {"kind": "nullable_int", "values": column.fillna(0).to_numpy(np.int64),
                                  "missing": column.isna().to_numpy()}
        elif pd.api.types.is_numeric_dtype(column) and not pd.api.types.is_bool_dtype(column):
            columns[str(name)] = {"kind": "number", "values": column.to_numpy()}
        else:
            codes, labels = pd.factorize(column, use_na_sentinel=False)
            columns[str(name)] = {"kind": "text", "codes": codes.astype(np.int32), "labels": [str(v) for v in labels]}
    return columns


def table_from_columns(columns: dict):
    """The pandas table ``table_columns`` took apart, with its dtypes."""
    import pandas as pd

    data = {}
    for name, column in columns.items():
        kind = column["kind"]
        if kind == "datetime":
            data[name] = pd.Series(np.asarray(column["ns"], dtype=np.int64).view("datetime64[ns]"))
        elif kind == "nullable_int":
            data[name] = pd.Series(pd.arrays.IntegerArray(np.array(column["values"], dtype=np.int64),
                                                          np.array(column["missing"], dtype=bool)))
        elif kind == "number":
            data[name] = pd.Series(np.array(column["values"]))
        elif kind == "text":
            labels = np.array(column["labels"], dtype=object)
            data[name] = pd.Series(labels[np.asarray(column["codes"], dtype=np.int64)]).astype("str")
        else:
            raise ValueError(f"column {name!r} of unknown kind {kind!r}")
    return pd.DataFrame(data)


# --- ETL --------------------------------------------------------------------------------------


def etl_inputs(seed: int, params: dict) -> dict:
    """Hidden trips and zones, sent as columns; the seed they came from stays here."""
    from fastdl_lab import tabular

    rows, seed = int(params.get("rows", 5000)), seed % (1 << 31)
    trips, zones = tabular.make_trips(rows, seed=seed)
    return {"trips": table_columns(trips), "zones": table_columns(zones), "rows": rows, "seed": seed}


def _etl_tables(inputs: dict):
    return table_from_columns(inputs["trips"]), table_from_columns(inputs["zones"])


def etl_drive(ns: dict, inputs: dict) -> dict:
    from fastdl_lab import tabular

    be = tabular.backend("auto")
    trips, zones = _etl_tables(inputs)
    if be.gpu:
        trips, zones = be.df.from_pandas(trips), be.df.from_pandas(zones)
    return {"table": _plain(ns["etl"](trips, zones)), "backend": be.name}


def etl_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import tabular

    trips, zones = _etl_tables(inputs)
    want = tabular.etl_ref(trips, zones)
    backend = outputs.get("backend") if isinstance(outputs, dict) else None
    try:
        got = _frame(outputs["table"] if isinstance(outputs, dict) else outputs)
        tabular.compare_tables(got, want, tabular.KEYS)
    except AssertionError as exc:
        return Verdict.failed(f"on {inputs['rows']} hidden trips ({backend}): {str(exc)[:500]}")
    return Verdict.passed(f"the {len(want)}-row summary of {inputs['rows']} hidden trips matches the reference "
                          f"({backend})")


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


def _split(seed: int, rows: int, share: float | None = None) -> dict:
    """Features of ``rows`` hidden trips, split three to one into training and test rows; the
    label is ``tabular.features``'s (a tip above 15% of the fare), or a tip above ``share``."""
    from fastdl_lab import tabular

    trips, _ = tabular.make_trips(rows, seed=seed)
    X, y = tabular.features(trips, tabular.backend("cpu"))
    X, y = X.to_numpy(np.float32), y.to_numpy(np.int32)
    if share is not None:
        # The rows features() keeps, in its order.
        usable = trips["fare"].notna() & (trips["distance_km"] > 0) & (trips["dropoff_at"] > trips["pickup_at"])
        kept = trips[usable]
        y = (kept["tip"] > share * kept["fare"]).to_numpy(np.int32)
    n_train = int(len(y) * 0.75)
    order = np.random.default_rng(seed).permutation(len(y))
    train, test = order[:n_train], order[n_train:]
    return {"X_train": X[train], "y_train": y[train], "X_test": X[test], "y_test": y[test]}


def ml_inputs(seed: int, params: dict) -> dict:
    """The training rows and labels and the test rows; the test labels and the seed stay here."""
    seed = seed % (1 << 31)
    return {**_split(seed, int(params.get("rows", 5000))), "seed": seed}


def _predictions(pred) -> np.ndarray:
    from fastdl_lab import tabular

    return np.asarray(tabular.to_numpy(pred)).reshape(-1).astype(np.int64)


def ml_drive(ns: dict, inputs: dict) -> dict:
    from fastdl_lab import tabular

    be = tabular.backend("auto")
    pred = ns["fit_predict"](inputs["X_train"], inputs["y_train"], inputs["X_test"], be.ml)
    return {"pred": _predictions(pred), "backend": be.name}


def _received_predictions(outputs, n: int) -> np.ndarray:
    pred = outputs.get("pred") if isinstance(outputs, dict) else outputs
    if not isinstance(pred, (np.ndarray, list)):
        raise AssertionError(f"predictions came back as {type(pred).__name__}")
    pred = np.asarray(pred)
    if pred.shape != (n,) or pred.dtype.kind not in "iub":
        raise AssertionError(f"{pred.size} predictions for {n} test rows")
    return pred.astype(np.int64)


def ml_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import tabular

    y_test = inputs["y_test"]
    try:
        pred = _received_predictions(outputs, len(y_test))
    except AssertionError as exc:
        return Verdict.failed(str(exc))
    reference = tabular.ml_ref(inputs["X_train"], inputs["y_train"], inputs["X_test"], tabular.backend("cpu"))
    best = max(tabular.accuracy(p, y_test) for name, p in reference.items() if name != "kmeans")
    majority = tabular.majority_rate(y_test)
    accuracy, slack = tabular.accuracy(pred, y_test), float(params.get("slack", 0.03))
    details = {"accuracy": accuracy, "reference": best, "majority": majority}
    if accuracy >= best - slack:
        return Verdict.passed(f"accuracy {accuracy:.3f} on hidden test labels (reference {best:.3f})", **details)
    if accuracy > majority + 0.01:
        return Verdict(0.5, f"accuracy {accuracy:.3f}: better than always guessing the majority ({majority:.3f}) "
                            f"but more than {slack:.2f} below the reference's {best:.3f}", details)
    return Verdict.failed(f"accuracy {accuracy:.3f}, no better than always guessing the majority ({majority:.3f})",
                          **details)


# --- speed on the grader's clock (GPU profiles) -----------------------------------------------


def _speed_backend():
    """cuDF/cuML where the child has a GPU. A GPU host without RAPIDS is the grading machine's fault
    (the item is not graded, and says why); with no GPU at all (a profile that times on the CPU, in
    tests) both sides run on pandas."""
    from autograder.engine.faults import MachineLacks
    from fastdl_lab import device, tabular

    be = tabular.backend("auto")
    if not be.gpu and device.has_gpu():
        raise MachineLacks(f"needs RAPIDS on this GPU host: {be.reason}")
    return be


def etl_speed_call(seed: int, params: dict, i: int) -> dict:
    """The ``i``-th call's fares and pickup zones for every trip of the table, drawn here: null fares
    and zones the table lacks change which trips count and where, so no earlier answer, scaled or
    not, is this call's."""
    rng = np.random.default_rng([seed % (1 << 31), i])
    n = int(params.get("rows", 5000))
    fare = np.round(rng.uniform(3.0, 80.0, n), 2)
    fare[rng.random(n) < 0.02] = np.nan
    return {"fare": fare, "pickup_zone": rng.integers(1, 266, n).astype(np.int64)}


def _etl_run(etl, be, inputs: dict):
    """``run(call) -> table``: ``etl`` on the item's trips with the call's columns, on ``be``."""
    trips, zones = _trips(inputs)
    if be.gpu:
        trips, zones = be.df.from_pandas(trips), be.df.from_pandas(zones)

    def run(call: dict) -> dict:
        fare, zone = np.asarray(call["fare"], dtype=np.float64), np.asarray(call["pickup_zone"], dtype=np.int64)
        if be.gpu:
            fare, zone = be.df.Series(fare, index=trips.index), be.df.Series(zone, index=trips.index)
        return _plain(etl(trips.assign(fare=fare, pickup_zone=zone), zones))

    return run


def etl_speed_candidate(ns: dict, inputs: dict):
    return _etl_run(ns["etl"], _speed_backend(), inputs)


def etl_speed_baseline(_ns: dict, inputs: dict):
    # The course's pipeline on pandas: the lab's point is one pipeline, two backends.
    from fastdl_lab import tabular

    return _etl_run(tabular.etl_ref, tabular.backend("cpu"), inputs)


def etl_speed_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    from fastdl_lab import tabular

    def differs(got, want, _call: int) -> str | None:
        try:
            tabular.compare_tables(_frame(got), _frame(want), tabular.KEYS)
        except AssertionError as exc:
            return f"returned another table ({str(exc)[:300]})"
        return None

    return clocked_speed(observed, params, differs, "your etl", "the reference pipeline on pandas")


def ml_speed_inputs(_seed: int, _params: dict) -> dict:
    return {}  # every call brings its own rows


def ml_speed_call(seed: int, params: dict, i: int) -> dict:
    """The ``i``-th call's training and test rows, from trips drawn here; its test labels are kept.

    Each call also asks its own question (a tip above a share of the fare drawn for the call) of
    features in an order drawn for it: a model fitted on an earlier call answers another question
    about other columns, so every call must fit its own."""
    rng = np.random.default_rng([seed % (1 << 31), i])
    trips_seed, share, order = int(rng.integers(1 << 30)), float(rng.uniform(0.09, 0.15)), rng.permutation(7)
    rows = _split(trips_seed, int(params.get("rows", 5000)), share)
    return {**{key: rows[key][:, order] for key in ("X_train", "X_test")},
            **{key: rows[key] for key in ("y_train", "y_test")}}


def _reference_fit_predict(X_train, y_train, X_test, ml):
    """The notebook's own answer: a random forest on the raw features."""
    return ml.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0).fit(X_train, y_train).predict(X_test)


def _ml_run(fit_predict, be):
    return lambda call: _predictions(fit_predict(call["X_train"], call["y_train"], call["X_test"], be.ml))


def ml_speed_candidate(ns: dict, _inputs: dict):
    return _ml_run(ns["fit_predict"], _speed_backend())


def ml_speed_baseline(_ns: dict, _inputs: dict):
    from fastdl_lab import tabular

    return _ml_run(_reference_fit_predict, tabular.backend("cpu"))


def ml_speed_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    from fastdl_lab import tabular

    slack, kept = float(params.get("slack", 0.05)), observed.timings.get("withheld") or []

    def differs(got, want, call: int) -> str | None:
        y_test = kept[call]["y_test"]
        try:
            pred = _received_predictions(got, len(y_test))
        except AssertionError as exc:
            return f"returned {exc}"
        mine, theirs = tabular.accuracy(pred, y_test), tabular.accuracy(want, y_test)
        if mine < theirs - slack:
            return (f"is {mine:.3f} accurate on the call's hidden test labels where the reference forest is "
                    f"{theirs:.3f}")
        return None

    return clocked_speed(observed, params, differs, "your fit_predict", "the reference forest on scikit-learn")


LAB = LabSpec(
    name="08_rapids",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("etl_pipeline", 4, ("etl_code",), etl_inputs, etl_drive, etl_check, artefacts=("etl",), scope=SCOPE,
             withheld=("seed",),
             description="clean, join, feature and aggregate hidden trips: the same table as the reference"),
        Item("vectorised", 2, ("vectorised_code",), vectorised_inputs, check=vectorised_check,
             kind="mechanism", artefacts=("fare_per_km",), scope=SCOPE, reference=lambda inputs: {},
             clocked=Clocked(vectorised_call, vectorised_candidate, vectorised_baseline, warmup=1, reps=5),
             description="a vectorised column against the row loop: same values, a ratio timed call by call "
                         "on the grader's clock"),
        Item("ml_predictions", 3, ("ml_code",), ml_inputs, ml_drive, ml_check, artefacts=("fit_predict",),
             scope=SCOPE, withheld=("y_test", "seed"),
             description="predictions judged on hidden test labels the function never sees"),
        Item("etl_gpu_speed", 2, ("etl_code",), _seeded, kind="speed", check=etl_speed_check, artefacts=("etl",),
             scope=SCOPE, reference=lambda inputs: {},
             clocked=Clocked(etl_speed_call, etl_speed_candidate, etl_speed_baseline, warmup=1, reps=5),
             description="your pipeline on cuDF against the reference on pandas, call by call on the grader's clock "
                         "(GPU profiles)"),
        Item("ml_gpu_speed", 2, ("ml_code",), ml_speed_inputs, kind="speed", check=ml_speed_check,
             artefacts=("fit_predict",), scope=SCOPE, reference=lambda inputs: {},
             clocked=Clocked(ml_speed_call, ml_speed_candidate, ml_speed_baseline, warmup=1, reps=5,
                             withheld=("y_test",)),
             description="your ML step on cuML against the reference forest on scikit-learn, call by call on the "
                         "grader's clock, judged on each call's hidden labels (GPU profiles)"),
    ],
)
