"""The lab 08 benchmark spec, ``benchmark`` and ``check``.

On a CPU: the row loop against vectorised pandas, each ETL step on a million rows, the Dask ETL on
two worker processes, scikit-learn fit times and the models' accuracy. With a working RAPIDS stack
(``backend("auto").gpu``) each ETL step and each model is also timed on cuDF/cuML beside
pandas/scikit-learn, on larger inputs; without one those rows are logged as "needs a GPU".
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from fastdl_lab.tabular import etl, ml
from fastdl_lab.tabular.backend import backend, from_pandas
from fastdl_lab.tabular.data import TINY_SUMMARY, make_trips, read_trips, tiny_trips, write_dataset

BENCHMARK = {
    "name": "tabular",
    "loop_rows": 20_000,
    "accuracy_rows": 20_000,
    "cpu": {"etl_rows": 1_000_000, "ml_shape": (100_000, 32)},
    "gpu": {"etl_rows": 10_000_000, "ml_shape": (100_000, 256)},
    "dask": {"workers": 2, "files": 4},
    "steps": ["read_csv", "read_parquet", "filter", "string_ops", "datetime_features", "join", "groupby"],
    "models": ["logistic_regression", "knn", "random_forest", "kmeans"],
    "knn_queries": 2_000,
    "gpu_only": ["cudf", "cuml"],
}

_COLUMNS = ("op", "step", "library", "rows", "cols", "median_s", "iqr_s", "speedup", "accuracy")


def _row(**values) -> dict:
    # One fixed set of columns, so every row of every run appends to the same CSV.
    return {name: values.get(name) for name in _COLUMNS}


def _etl_steps(trips, zones, csv_path: Path, parquet_path: Path, be) -> dict[str, Callable]:
    """Each step as a call on the output of the step before it, computed here once."""
    cleaned = etl.clean(trips, be)
    normalised = etl.normalise_payment(cleaned, be)
    featured = etl.add_time_features(normalised, be)
    joined = etl.join_zones(featured, zones, be)
    return {
        "read_csv": lambda: read_trips(csv_path, be),
        "read_parquet": lambda: read_trips(parquet_path, be),
        "filter": lambda: etl.clean(trips, be),
        "string_ops": lambda: etl.normalise_payment(cleaned, be),
        "datetime_features": lambda: etl.add_time_features(normalised, be),
        "join": lambda: etl.join_zones(featured, zones, be),
        "groupby": lambda: etl.aggregate(joined, be),
    }


def _bench_etl(n_rows: int, reps: int, folder: Path, backends: list, log) -> list[dict]:
    from fastdl_lab import timing

    trips, zones = make_trips(n_rows, seed=1)
    (csv_path,), _ = write_dataset(trips, zones, folder / "csv", fmt="csv")
    (parquet_path,), _ = write_dataset(trips, zones, folder / "parquet", fmt="parquet")
    timings = {}
    for be in backends:
        steps = _etl_steps(from_pandas(trips, be), from_pandas(zones, be), csv_path, parquet_path, be)
        for step in BENCHMARK["steps"]:
            timings[be.name, step] = timing.bench(steps[step], warmup=1, reps=reps)
    rows = []
    for (library, step), t in timings.items():
        speedup = timings["pandas", step].median / t.median
        rows.append(_row(op="etl", step=step, library=library, rows=n_rows, median_s=t.median, iqr_s=t.iqr,
                         speedup=speedup))
        log(f"etl {step:>17} {library:>6} {n_rows:>10,} rows: {t.median * 1e3:9.1f} ms  {speedup:6.2f}x pandas")
    return rows


def _bench_loop(reps: int, log) -> dict:
    from fastdl_lab import timing

    trips, _ = make_trips(BENCHMARK["loop_rows"], seed=2)
    cmp = timing.compare(lambda: etl.fare_per_km_ref(trips), lambda: etl.fare_per_km_loop(trips),
                         warmup=1, reps=reps)
    log(f"fare per km, {len(trips):,} rows: row loop {cmp.baseline.median * 1e3:.1f} ms, "
        f"vectorised {cmp.candidate.median * 1e3:.2f} ms: {cmp.speedup:.0f}x")
    return _row(op="fare_per_km", step="vectorised_vs_loop", library="pandas", rows=len(trips),
                median_s=cmp.candidate.median, iqr_s=cmp.candidate.iqr, speedup=cmp.speedup)


def _bench_dask(n_rows: int, reps: int, folder: Path, log) -> list[dict]:
    from fastdl_lab import timing
    from fastdl_lab.tabular import scale

    spec = BENCHMARK["dask"]
    trips, zones = make_trips(n_rows, seed=1)
    paths, _ = write_dataset(trips, zones, folder / "dask", n_files=spec["files"])
    be = backend("cpu")
    single = timing.bench(lambda: etl.etl_ref(pd.concat([read_trips(p, be) for p in paths]), zones),
                          warmup=1, reps=reps)
    start = time.perf_counter()
    with scale.dask_cluster(spec["workers"]):
        started = time.perf_counter() - start
        t = timing.bench(lambda: scale.etl_dask_compute(paths, zones), warmup=1, reps=reps)
    speedup = single.median / t.median
    log(f"etl dask, {spec['workers']} workers, {n_rows:,} rows in {spec['files']} files: {t.median:.2f} s "
        f"({speedup:.2f}x one pandas process at {single.median:.2f} s); cluster start {started:.1f} s")
    return [_row(op="etl_dask", step="read+etl", library="pandas", rows=n_rows, median_s=single.median,
                 iqr_s=single.iqr, speedup=1.0),
            _row(op="etl_dask", step="read+etl", library=f"dask x{spec['workers']}", rows=n_rows,
                 median_s=t.median, iqr_s=t.iqr, speedup=speedup),
            _row(op="etl_dask", step="cluster_start", library=f"dask x{spec['workers']}", median_s=started)]


def _model_fns(be, X, y, queries) -> dict[str, Callable]:
    ml_ = be.ml
    return {
        "logistic_regression": lambda: ml_.LogisticRegression(max_iter=1000).fit(X, y),
        # A k-NN "fit" only stores the data: the work is in the queries, so time both.
        "knn": lambda: ml_.KNeighborsClassifier(n_neighbors=15).fit(X, y).predict(queries),
        "random_forest": lambda: ml_.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0).fit(X, y),
        "kmeans": lambda: ml_.KMeans(n_clusters=8, n_init=3, random_state=0).fit(X),
    }


def _bench_models(shape: tuple[int, int], reps: int, backends: list, log) -> list[dict]:
    from sklearn.datasets import make_classification

    from fastdl_lab import timing

    n, d = shape
    X, y = make_classification(n_samples=n, n_features=d, n_informative=min(d, 16), random_state=0)
    X, y = X.astype(np.float32), y.astype(np.int32)
    timings = {}
    for be in backends:
        Xb, yb = be.np.asarray(X), be.np.asarray(y)
        fns = _model_fns(be, Xb, yb, Xb[:BENCHMARK["knn_queries"]])
        for model in BENCHMARK["models"]:
            # Fits of seconds each: one warm-up and few samples keep the run within minutes.
            timings[be.name, model] = timing.bench(fns[model], warmup=1, reps=min(reps, 3))
    rows = []
    for (library, model), t in timings.items():
        speedup = timings["pandas", model].median / t.median
        name = "sklearn" if library == "pandas" else "cuml"
        step = "fit+predict" if model == "knn" else "fit"
        rows.append(_row(op=f"ml_{step}", step=model, library=name, rows=n, cols=d, median_s=t.median,
                         iqr_s=t.iqr, speedup=speedup))
        log(f"ml {model:>19} {name:>7} {n:,}x{d}: {t.median:8.3f} s  {speedup:6.2f}x sklearn")
    return rows


def _accuracy_rows(be, log) -> list[dict]:
    trips, _ = make_trips(BENCHMARK["accuracy_rows"], seed=3)
    scores = ml.evaluate(trips, be)
    log("accuracy, " + ", ".join(f"{name} {value:.3f}" for name, value in scores.items()))
    library = "cuml" if be.gpu else "sklearn"
    return [_row(op="ml_accuracy", step=name, library=library, rows=len(trips), accuracy=value)
            for name, value in scores.items()]


def benchmark(reps: int = 5, log: Callable[[str], None] = print) -> list[dict]:
    """Every measurement this machine can make; one dict per row of ``benchmarks/results/tabular.csv``."""
    gpu = backend("auto")
    log(f"backend: {gpu.name} ({gpu.reason})")
    cpu = backend("cpu")
    backends = [cpu, gpu] if gpu.gpu else [cpu]
    spec = BENCHMARK["gpu" if gpu.gpu else "cpu"]
    rows = [_bench_loop(reps, log)]
    with tempfile.TemporaryDirectory(prefix="fastdl-tabular-") as tmp:
        rows += _bench_etl(spec["etl_rows"], reps, Path(tmp), backends, log)
        rows += _bench_dask(BENCHMARK["cpu"]["etl_rows"], min(reps, 3), Path(tmp), log)
    rows += _bench_models(spec["ml_shape"], reps, backends, log)
    rows += _accuracy_rows(gpu, log)
    if not gpu.gpu:
        log(f"{', '.join(BENCHMARK['gpu_only'])}: needs a GPU ({gpu.reason})")
    return rows


def check() -> None:
    """The ETL on the hand-made trips, the loop against the vectorised form, compare_tables itself."""
    trips, zones = tiny_trips()
    etl.compare_tables(etl.etl_ref(trips, zones), TINY_SUMMARY, etl.KEYS)
    try:
        etl.compare_tables(TINY_SUMMARY.iloc[1:], TINY_SUMMARY, etl.KEYS)
    except AssertionError:
        pass
    else:
        raise AssertionError("compare_tables missed a missing row")
    sample, _ = make_trips(2_000, seed=4)
    loop, vectorised = etl.fare_per_km_loop(sample), etl.fare_per_km_ref(sample)
    np.testing.assert_allclose(vectorised.to_numpy(dtype="float64"), loop.to_numpy(), rtol=1e-12)
    print(f"tabular: checks passed (backend {backend('auto').reason}; "
          f"{int(loop.isna().sum())} of {len(loop)} trips have no fare per km)")
