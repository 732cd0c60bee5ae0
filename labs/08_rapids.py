# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 08 — RAPIDS: dataframes and machine learning on the GPU, written once
#
# Training a network is not the only work that runs for hours: cleaning, joining and aggregating
# the data that feeds it, and classical machine learning on tables, often dominate a project's
# compute. RAPIDS moves that work to the GPU with libraries that copy the APIs people already use:
# **cuDF** follows pandas, **cuML** follows scikit-learn, **dask-cuDF** spreads a cuDF frame over
# several GPUs. In this lab you will:
#
# 1. see the first speed-up anyone can get on any machine: whole-column operations instead of a
#    Python loop over rows *(sections 1–2, about 45 minutes; graded: `vectorised`, 2 points)*;
# 2. write an ETL pipeline (clean, normalise strings, datetime features, a left join, a grouped
#    aggregation) **once**, against the API pandas and cuDF share *(section 3, about 60 minutes;
#    graded: `etl_pipeline`, 4 points)*;
# 3. train and predict with models that exist in both scikit-learn and cuML *(section 5, about
#    40 minutes; graded: `ml_predictions`, 3 points)*;
# 4. on a GPU host, run the same code on cuDF and cuML *(graded on GPU profiles: `etl_gpu_speed`,
#    `ml_gpu_speed`, 2 points each)*, meet `cudf.pandas`, and spread the pipeline over several
#    processes with Dask *(sections 4 and 6, about 40 minutes)*.
#
# **How this lab is graded.** The grader takes only your functions (and literal constants) out of
# the solution cells and runs each on its own, with `math`, `np` (NumPy) and `day_of_week` as the
# only names available besides what it passes in: no imports inside them, no `getattr`/`eval`, no
# `_private` attributes of other objects. It generates its own hidden trips, so a function must
# work for any data of this shape.
#
# **Time:** about 3 hours for a student who has done the labs before it, by section in minutes: §1
# 15; §2 30; §3 60; §4 20; §5 40; §6 20. Graded code regions take most of it; the estimates are
# the course's, not measured on a class.

# %%
from fastdl_lab import device

print(device.describe())

# %%
import time

import matplotlib.pyplot as plt
import numpy as np

from fastdl_lab import tabular, timing
from fastdl_lab.tabular import day_of_week  # noqa: F401  (one of the grader's names, for your cells)

be = tabular.backend("auto")
print(f"backend: {be.name} ({be.reason})")
# FASTDL_QUICK=1 (the grader's run of your notebook, and the tests'): experiments at tiny sizes.
QUICK = device.quick()

# %% [markdown]
# ## 1. The data: a month of taxi trips, with the usual faults
#
# `tabular.make_trips` generates trips shaped like a city's taxi records: pickup and dropoff times
# with rush-hour peaks, pickup zones drawn from a skewed distribution (a few zones have most of the
# trips), and the faults real data has: missing fares and passenger counts, zero and negative
# distances, dropoffs before pickups, payment types spelt five ways, and zones the zone table does
# not know. On a GPU host the lab uses millions of rows; here, tens of thousands.

# %%
ROWS = 8_000 if QUICK else 2_000_000 if be.gpu else 40_000
trips, zones = tabular.make_trips(ROWS, seed=0)
print(trips.dtypes, "\n")
print(trips.head())
print("\nnull fares:", int(trips["fare"].isna().sum()), "| null passengers:", int(trips["passengers"].isna().sum()),
      "| distance <= 0:", int((trips["distance_km"] <= 0).sum()),
      "| dropoff before pickup:", int((trips["dropoff_at"] <= trips["pickup_at"]).sum()))
print("payment spellings:", sorted(trips["payment"].unique().tolist()))
share = trips["pickup_zone"].value_counts(normalize=True)
print(f"busiest zone: {share.iloc[0]:.1%} of trips (uniform would be {1 / len(zones):.2%}); "
      f"zones unknown to the zone table: {int((~trips['pickup_zone'].isin(zones['zone_id'])).sum())} trips")

# %% [markdown]
# ## 2. Row by row, or column by column
#
# A fare per kilometre, with a 2.5 surcharge for pickups in the evening rush (16:00 to 19:59), and
# NaN where the distance is not positive or the fare is missing. Written as a loop over rows it is
# obvious, and slow: every row becomes a Python object, every field a dictionary lookup, every
# operation an interpreted bytecode. `tabular.fare_per_km_loop` is that loop.
#
# Write `fare_per_km(trips)` with **whole-column** operations: `trips["pickup_at"].dt.hour`,
# comparisons that give boolean columns, arithmetic on columns, and `.where(condition)` to put NaN
# where the condition is false. One C loop (or one GPU kernel) per operation, instead of one
# Python step per row. The grader times yours against the row loop, interleaved, on a fresh copy of
# hidden trips for every call: it must give the same values and be at least 20× faster.

# %% nbgrader={"grade_id": "vectorised_code", "solution": true}
RUSH_FIRST, RUSH_LAST, SURCHARGE = 16, 19, 2.5


def fare_per_km(trips):
    ### BEGIN SOLUTION
    hour = trips["pickup_at"].dt.hour
    rush = (hour >= RUSH_FIRST) & (hour <= RUSH_LAST)
    per_km = (trips["fare"] + SURCHARGE * rush.astype("float64")) / trips["distance_km"]
    return per_km.where(trips["distance_km"] > 0)
    ### END SOLUTION


# %% nbgrader={"grade_id": "vectorised", "grade": true, "points": 2}
import numpy as np

from fastdl_lab import tabular, timing

_trips, _ = tabular.make_trips(2000, seed=3)
_want = tabular.fare_per_km_loop(_trips).to_numpy()
_got = np.asarray(fare_per_km(_trips), dtype=float)
assert _got.shape == _want.shape, f"{_got.shape} values for {_want.shape} trips"
np.testing.assert_allclose(_got, _want, rtol=1e-6, equal_nan=True)
_cmp = timing.compare(lambda: fare_per_km(_trips), lambda: tabular.fare_per_km_loop(_trips), warmup=1, reps=3)
print(f"vectorised: {_cmp.speedup:.0f}x faster than the row loop on {len(_trips)} trips")
print("vectorised: visible tests passed")
### BEGIN HIDDEN TESTS
_trips, _ = tabular.make_trips(1500, seed=4)
np.testing.assert_allclose(np.asarray(fare_per_km(_trips), dtype=float), tabular.fare_per_km_loop(_trips).to_numpy(),
                           rtol=1e-6, equal_nan=True)
### END HIDDEN TESTS

# %% [markdown]
# How the two scale with the number of rows (the loop on the smaller sizes only):

# %%
sizes = [500, 2_000] if QUICK else [1_000, 4_000, 16_000]
loop_s = [timing.bench(lambda n=n: tabular.fare_per_km_loop(trips.iloc[:n]), warmup=0, reps=2).median for n in sizes]
vec_s = [timing.bench(lambda n=n: fare_per_km(trips.iloc[:n]), warmup=1, reps=5).median for n in sizes]
plt.loglog(sizes, loop_s, "o-", label="row loop (iterrows)")
plt.loglog(sizes, vec_s, "o-", label="whole columns")
plt.xlabel("rows")
plt.ylabel("seconds")
plt.legend()
plt.show()
print(f"at {sizes[-1]} rows: {loop_s[-1] / vec_s[-1]:.0f}x")

# %% [markdown]
# ## 3. An ETL pipeline written once
#
# The question: **how busy, how expensive and how card-paid is each borough at each hour?** Write
# `etl(trips, zones)` returning one row per (`borough`, `hour`) with these columns:
#
# | column | meaning |
# |---|---|
# | `borough`, `hour` | the pickup zone's borough (`"Unknown"` for a zone the table lacks), the pickup hour |
# | `trips` | usable trips |
# | `mean_fare`, `mean_distance_km` | means over those trips |
# | `mean_passengers` | mean over trips whose passenger count is known (a missing count is not 0) |
# | `card_share` | fraction paid by card |
#
# Write it in two functions: `prepare(trips, zones)` does steps 1 to 4 (one row per usable trip,
# keeping `trip_id`, `fare`, `distance_km`, `passengers`, with the normalised `payment`, `hour` and
# `borough`), and `etl(trips, zones)` aggregates what `prepare` returns (step 5). Section 6 runs
# your `prepare` on Dask workers.
#
# 1. **clean**: keep trips with a fare, a positive distance and a dropoff after the pickup;
# 2. **normalise** `payment`: strip spaces and lower-case; anything but `card` or `cash` is `other`;
# 3. **features**: the pickup `hour` (`.dt.hour`);
# 4. **join**: a *left* join of `zones[["zone_id", "borough"]]` on `pickup_zone` = `zone_id`, then
#    fill the missing boroughs with `"Unknown"` (an inner join would silently drop those trips);
# 5. **aggregate**: `groupby(["borough", "hour"]).agg(...)`, then `reset_index()`.
#
# Use only calls pandas and cuDF share: boolean masks, `.str.strip()`, `.str.lower()`, `.isin`,
# `.where`, `.dt.hour`, `.merge`, `.fillna`, `.assign`, `.groupby(...).agg({...})`, `.rename`,
# `.reset_index`. **No `.apply` with a Python function**: pandas runs it in the interpreter, once
# per row, and cuDF runs it only if Numba can compile it into a GPU kernel (`Series.apply`,
# `DataFrame.apply(axis=1)`: numeric, boolean and datetime columns and a few string methods; no
# arbitrary Python objects or library calls), so the same function can be slow on one library and
# refused by the other. The grader compares your table with the reference on hidden trips,
# ignoring row and column order, with a tolerance on floats.

# %% nbgrader={"grade_id": "etl_code", "solution": true}
def prepare(trips, zones):
    """Steps 1 to 4: one row per usable trip, with payment normalised, hour and borough."""
    ### BEGIN SOLUTION
    keep = trips["fare"].notna() & (trips["distance_km"] > 0) & (trips["dropoff_at"] > trips["pickup_at"])
    rows = trips[keep]
    payment = rows["payment"].str.strip().str.lower()
    rows = rows.assign(payment=payment.where(payment.isin(["card", "cash"]), "other"),
                       hour=rows["pickup_at"].dt.hour)
    rows = rows.merge(zones[["zone_id", "borough"]], how="left", left_on="pickup_zone", right_on="zone_id")
    return rows.assign(borough=rows["borough"].fillna("Unknown"))
    ### END SOLUTION


def etl(trips, zones):
    """Step 5 on top of ``prepare``: the (borough, hour) summary."""
    ### BEGIN SOLUTION
    rows = prepare(trips, zones)
    rows = rows.assign(card=(rows["payment"] == "card").astype("float64"))
    table = rows.groupby(["borough", "hour"]).agg({"trip_id": "count", "fare": "mean", "distance_km": "mean",
                                                   "passengers": "mean", "card": "mean"})
    table = table.rename(columns={"trip_id": "trips", "fare": "mean_fare", "distance_km": "mean_distance_km",
                                  "passengers": "mean_passengers", "card": "card_share"})
    return table.reset_index()
    ### END SOLUTION


# %% nbgrader={"grade_id": "etl_pipeline", "grade": true, "points": 4}
from fastdl_lab import tabular

# A hand-made table whose summary was worked out by hand: an unknown zone, a missing passenger
# count, messy payment strings and every kind of bad row.
tabular.compare_tables(etl(*tabular.tiny_trips()), tabular.TINY_SUMMARY, ["borough", "hour"])
_table = etl(*tabular.make_trips(3000, seed=5))
assert set(_table.columns) == {"borough", "hour", "trips", "mean_fare", "mean_distance_km", "mean_passengers",
                               "card_share"}, sorted(_table.columns)
assert "Unknown" in set(_table["borough"]), "trips from zones the table lacks must be kept (a left join)"
print("etl_pipeline: visible tests passed")
### BEGIN HIDDEN TESTS
_t, _z = tabular.make_trips(4000, seed=6)
assert int(_table["trips"].sum()) > 0 and int(etl(_t, _z)["trips"].sum()) == int(
    (_t["fare"].notna() & (_t["distance_km"] > 0) & (_t["dropoff_at"] > _t["pickup_at"])).sum())
### END HIDDEN TESTS

# %% [markdown]
# Each step timed on this machine's backend, to see where an ETL spends its time (on a GPU host,
# run it again with `be = tabular.backend("gpu")` and compare):

# %%
summary = etl(trips, zones)
print(summary.head(8))
steps = {
    "clean": lambda: trips[trips["fare"].notna() & (trips["distance_km"] > 0)],
    "strings": lambda: trips["payment"].str.strip().str.lower(),
    "datetime": lambda: trips["pickup_at"].dt.hour,
    "join": lambda: trips.merge(zones, how="left", left_on="pickup_zone", right_on="zone_id"),
    "groupby": lambda: trips.groupby("pickup_zone").agg({"fare": "mean", "distance_km": "mean"}),
    "whole etl": lambda: etl(trips, zones),
}
timing.table({name: timing.bench(fn, warmup=1, reps=5) for name, fn in steps.items()})[["median_s", "iqr_s"]]

# %% [markdown]
# ## 4. The same code on the GPU: cuDF and `cudf.pandas`
#
# On a GPU host with RAPIDS installed (`pip install -e '.[rapids]'`), `tabular.backend("gpu")`
# gives cuDF: `be.df.from_pandas(trips)` copies a frame to the device, and **your `etl` runs on it
# unchanged**, every step a GPU kernel. The graded comparison (`etl_gpu_speed`) times your function
# on cuDF against the course's pipeline on pandas.
#
# RAPIDS also offers a zero-code-change path: `%load_ext cudf.pandas` *before* importing pandas
# makes `import pandas` return a proxy that runs each call on the GPU when cuDF supports it and
# falls back to pandas (copying the data back) when it does not. Existing notebooks speed up
# without edits; the cost of a fallback is a device-host round trip, which `cudf.pandas`'s profiler
# (`%%cudf.pandas.profile`) shows call by call.

# %%
if be.gpu:
    gpu_trips, gpu_zones = be.df.from_pandas(trips), be.df.from_pandas(zones)
    cmp = timing.compare(lambda: etl(gpu_trips, gpu_zones), lambda: etl(trips, zones))
    print(f"your etl on cuDF vs pandas, {ROWS:,} trips: {cmp.speedup:.1f}x")
    tabular.compare_tables(etl(gpu_trips, gpu_zones), etl(trips, zones), ["borough", "hour"])
else:
    print("needs a GPU (and RAPIDS): cuDF and cudf.pandas run only on a CUDA device")

# %% [markdown]
# `cudf.pandas` needs no change to the code at all. Here it runs a plain pandas script twice, once as
# it is and once under the accelerator (`python -m cudf.pandas script.py` is the command-line form of
# `%load_ext cudf.pandas`):

# %%
import subprocess
import sys
import tempfile
from pathlib import Path

if be.gpu:
    with tempfile.TemporaryDirectory(prefix="fastdl-cudf-pandas-") as folder:
        script = Path(folder) / "plain_pandas.py"
        script.write_text(
            "import time\n"
            "import numpy as np\n"
            "import pandas as pd\n"
            "rng = np.random.default_rng(0)\n"
            "df = pd.DataFrame({'key': rng.integers(0, 1000, 20_000_000), 'x': rng.random(20_000_000)})\n"
            "start = time.perf_counter()\n"
            "df.groupby('key')['x'].mean().sort_index()\n"
            "print(f'{time.perf_counter() - start:.3f}')\n")
        plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
        accelerated = subprocess.run([sys.executable, "-m", "cudf.pandas", str(script)], capture_output=True, text=True,
                                     check=True).stdout
        print(f"groupby-mean of 20M rows: pandas {plain.strip()} s, under cudf.pandas {accelerated.strip()} s")
else:
    print("needs a GPU (and RAPIDS): cudf.pandas accelerates only on a CUDA device")

# %% [markdown]
# ## 5. Machine learning on the same tables
#
# Will the passenger tip more than 15% of the fare? `tabular.features` turns trips into seven
# numeric features (distance, duration, hour, weekday, passengers, fare, paid by card) and a 0/1
# label. Write `fit_predict(X_train, y_train, X_test, ml)`: fit a classifier on the training rows
# and return its 0/1 predictions for `X_test`. `ml` is the backend's model namespace, the same
# names in scikit-learn and cuML: `ml.LogisticRegression`, `ml.KNeighborsClassifier`,
# `ml.RandomForestClassifier`, `ml.StandardScaler`, `ml.KMeans`. The grader keeps the test labels
# to itself and scores your predictions: within 0.03 of the best reference model's accuracy for full
# marks.

# %% nbgrader={"grade_id": "ml_code", "solution": true}
def fit_predict(X_train, y_train, X_test, ml):
    ### BEGIN SOLUTION
    model = ml.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0)
    return model.fit(X_train, y_train).predict(X_test)
    ### END SOLUTION


# %% nbgrader={"grade_id": "ml_predictions", "grade": true, "points": 3}
import numpy as np

from fastdl_lab import tabular

_be = tabular.backend("cpu")
_X, _y = tabular.features(tabular.make_trips(8000, seed=7)[0], _be)
_X, _y = _X.to_numpy(), _y.to_numpy()
_pred = np.asarray(fit_predict(_X[:6000], _y[:6000], _X[6000:], _be.ml))
assert _pred.shape == _y[6000:].shape, f"{_pred.shape} predictions for {_y[6000:].shape} rows"
_acc, _majority = tabular.accuracy(_pred, _y[6000:]), tabular.majority_rate(_y[6000:])
assert _acc > _majority + 0.05, f"accuracy {_acc:.3f} is barely above always guessing the majority ({_majority:.3f})"
print(f"accuracy {_acc:.3f} (majority {_majority:.3f})")
print("ml_predictions: visible tests passed")
### BEGIN HIDDEN TESTS
_frames = tabular.features(tabular.make_trips(8000, seed=8)[0], _be)
_X2, _y2 = (f.to_numpy() for f in _frames)
_acc2 = tabular.accuracy(np.asarray(fit_predict(_X2[:6000], _y2[:6000], _X2[6000:], _be.ml)), _y2[6000:])
assert _acc2 > tabular.majority_rate(_y2[6000:]) + 0.05, _acc2
### END HIDDEN TESTS

# %% [markdown]
# Four models side by side, each fitted on the backend at hand (`evaluate` uses the reference
# `ml_ref`; on a GPU host pass `tabular.backend("gpu")` and the same calls run on cuML):

# %%
X, y = tabular.features(trips, be)
X_train, X_test, y_train, y_test = be.ml.train_test_split(X.to_numpy(), y.to_numpy(), test_size=0.25, random_state=0)
started = time.perf_counter()
mine = tabular.accuracy(fit_predict(X_train, y_train, X_test, be.ml), y_test)
print(f"your fit_predict: accuracy {mine:.3f} in {time.perf_counter() - started:.2f} s "
      f"(majority {tabular.majority_rate(y_test):.3f})")
if be.gpu:
    cmp = timing.compare(lambda: fit_predict(X_train, y_train, X_test, be.ml),
                         lambda: fit_predict(X_train, y_train, X_test, tabular.backend("cpu").ml), reps=3)
    print(f"cuML vs scikit-learn: {cmp.speedup:.1f}x")
else:
    print("cuML vs scikit-learn: needs a GPU")

# %% [markdown]
# ## 6. Past one device: Dask
#
# A table larger than one machine's (or one GPU's) memory is cut into **partitions**, and a
# scheduler runs the same pandas (or cuDF) operations on each partition in worker processes, then
# combines the partial results. `dask.dataframe` mirrors the pandas API; with `dask_cudf` each
# worker owns one GPU. Aggregations must be written so that partial results combine: a mean is a
# sum and a count per partition, added up and divided at the end.
#
# `tabular.dask_cluster(n_workers)` starts a local cluster of worker *processes* and always shuts
# it down, even when the cell fails; `tabular.etl_dask` runs your `prepare` on each partition (one
# per Parquet file) in the workers, aggregates sums and counts, and must give the same table as
# your `etl` on all the trips at once. The grader's quick run of your notebook runs the workers
# as threads of the notebook's own process (`processes=False`): the same graph and scheduler,
# without the seconds a worker process takes to start.

# %%
import tempfile
from pathlib import Path

many, _ = tabular.make_trips(3_000 if QUICK else 30_000, seed=10)
workers = 1 if QUICK else 2
with tempfile.TemporaryDirectory(prefix="fastdl-trips-") as folder:
    paths, _ = tabular.write_dataset(many, zones, Path(folder), fmt="parquet", n_files=3)
    started = time.perf_counter()
    distributed = tabular.etl_dask([str(p) for p in paths], zones, n_workers=workers, prepare=prepare,
                                   processes=not QUICK)
print(f"Dask, {workers} worker {'thread(s)' if QUICK else 'process(es)'}, {len(paths)} partitions: "
      f"{time.perf_counter() - started:.1f} s (most of it starting the cluster: on one small machine a "
      "single pandas process wins)")
tabular.compare_tables(distributed, etl(many, zones), ["borough", "hour"])
print("the distributed table equals yours")

# %% [markdown]
# ## GPU speed items
#
# On GPU profiles the grader times, call by call on its own clock, your `etl` on cuDF against the
# course's pipeline on pandas, and your `fit_predict` on cuML against the course's random forest on
# scikit-learn. Every call brings data no call has seen (new fares and pickup zones; new trips,
# with its own tip threshold and its columns in its own order), and each of your answers is checked
# against the reference's answer to the same call before the times count.

# %% nbgrader={"grade_id": "etl_gpu_speed", "grade": true, "points": 2}
from fastdl_lab import tabular

if tabular.backend("auto").gpu:
    print("etl_gpu_speed: graded by the course's grader on a GPU profile")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% nbgrader={"grade_id": "ml_gpu_speed", "grade": true, "points": 2}
from fastdl_lab import tabular

if tabular.backend("auto").gpu:
    print("ml_gpu_speed: graded by the course's grader on a GPU profile")
else:
    print("needs a GPU: speed is graded only on GPU profiles")

# %% [markdown]
# ## Summary
#
# - A Python loop over rows pays the interpreter per row; whole-column operations pay it per
#   column. That is the first and largest speed-up, on any hardware.
# - pandas and cuDF (and scikit-learn and cuML) share their APIs: a pipeline written against the
#   common calls runs on either, and moving it to the GPU is a matter of where the frame lives.
#   `.apply` with a Python function is the usual thing that does not move whole: cuDF compiles it
#   with Numba only when it sticks to numbers, booleans, dates and a few string methods, and
#   `cudf.pandas` runs the rest on the CPU.
# - A left join keeps rows whose key has no match; an inner join drops them silently. Means skip
#   missing values; filling them with 0 first changes the answer.
# - Past one device, the same operations run per partition and combine: write aggregations whose
#   partial results can be added.
