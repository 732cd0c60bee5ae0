"""The trip ETL written once for pandas and cuDF, the table comparison that grades it, and the
row loop against its vectorised form.

Every call here exists in both libraries with the same meaning: boolean masks, ``.str`` and
``.dt`` accessors, ``where``, ``merge`` and ``groupby().agg``. Nothing calls ``.apply`` with a
Python function: pandas interprets it once per row, and cuDF runs it on the GPU only if Numba can
compile it (numbers, booleans, dates and a few string methods; no arbitrary Python objects or
library calls).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fastdl_lab.tabular.backend import Backend, day_of_week, to_pandas
from fastdl_lab.tabular.data import RUSH_HOURS

RUSH_SURCHARGE = 2.5
PAYMENTS = ("card", "cash")
KEYS = ["borough", "hour"]


# ---------------------------------------------------------------------------------------------
# The ETL, one step per function so that each can be timed on its own.


def clean(trips, be: Backend | None = None):
    """Drop the rows no analysis can use: null fare, distance <= 0, dropoff not after pickup."""
    ### BEGIN SOLUTION
    keep = trips["fare"].notna() & (trips["distance_km"] > 0) & (trips["dropoff_at"] > trips["pickup_at"])
    return trips[keep]
    ### END SOLUTION


def normalise_payment(trips, be: Backend | None = None):
    """``payment`` stripped and lower-cased; anything but card or cash becomes "other"."""
    ### BEGIN SOLUTION
    payment = trips["payment"].str.strip().str.lower()
    return trips.assign(payment=payment.where(payment.isin(list(PAYMENTS)), "other"))
    ### END SOLUTION


def add_time_features(trips, be: Backend | None = None):
    """``hour`` and ``weekday`` of the pickup, and ``duration_min``."""
    ### BEGIN SOLUTION
    # Dividing by a one-minute timedelta works at any datetime resolution (pandas 3 reads
    # microseconds from text, nanoseconds elsewhere) and in cuDF.
    duration = (trips["dropoff_at"] - trips["pickup_at"]) / np.timedelta64(60, "s")
    return trips.assign(hour=trips["pickup_at"].dt.hour, weekday=day_of_week(trips["pickup_at"]),
                        duration_min=duration)
    ### END SOLUTION


def join_zones(trips, zones, be: Backend | None = None):
    """Left join on the pickup zone: a trip from a zone the table lacks is kept, borough "Unknown"."""
    ### BEGIN SOLUTION
    joined = trips.merge(zones[["zone_id", "borough"]], how="left", left_on="pickup_zone", right_on="zone_id")
    return joined.drop(columns=["zone_id"]).assign(borough=joined["borough"].fillna("Unknown"))
    ### END SOLUTION


def prepare_trips(trips, zones, be: Backend | None = None):
    """Every row-wise step: one row per usable trip, with features and borough."""
    ### BEGIN SOLUTION
    rows = add_time_features(normalise_payment(clean(trips, be), be), be)
    return join_zones(rows, zones, be)
    ### END SOLUTION


def aggregate(rows, be: Backend | None = None):
    """Per (borough, hour): trips, mean fare, distance and passengers (nulls skipped), card share."""
    ### BEGIN SOLUTION
    rows = rows.assign(card=(rows["payment"] == "card").astype("float64"))
    table = rows.groupby(KEYS).agg({"trip_id": "count", "fare": "mean", "distance_km": "mean",
                                    "passengers": "mean", "card": "mean"})
    table = table.rename(columns={"trip_id": "trips", "fare": "mean_fare", "distance_km": "mean_distance_km",
                                  "passengers": "mean_passengers", "card": "card_share"})
    return table.reset_index().sort_values(KEYS).reset_index(drop=True)
    ### END SOLUTION


def etl_ref(trips, zones, be: Backend | None = None):
    """Trips in, the (borough, hour) summary out, sorted by borough then hour.

    ``be`` is not needed by this version (pandas and cuDF share every call it makes); a student's
    version may use ``be.np`` or ``be.df``.
    """
    ### BEGIN SOLUTION
    return aggregate(prepare_trips(trips, zones, be), be)
    ### END SOLUTION


# ---------------------------------------------------------------------------------------------
# Comparing two tables


def _comparable(frame, keys) -> pd.DataFrame:
    """Values as float64 with NaN for null, others (and keys) as objects with None for null."""
    frame = to_pandas(frame).reset_index(drop=True)
    out = {}
    for name in frame.columns:
        column = frame[name]
        if name in keys:
            # Keys keep their values (1 and 1.0 are equal and hash alike) to show as written.
            out[name] = column.astype("object").where(column.notna(), None)
        elif pd.api.types.is_bool_dtype(column) or pd.api.types.is_numeric_dtype(column):
            out[name] = column.astype("float64") if column.notna().all() else \
                pd.to_numeric(column.astype("object").where(column.notna(), np.nan), errors="coerce")
        else:
            out[name] = column.astype("object").where(column.notna(), None)
    return pd.DataFrame(out).sort_values(keys, na_position="last").reset_index(drop=True)


def _key_text(row, keys) -> str:
    return ", ".join(f"{k}={row[k]!r}" for k in keys)


def compare_tables(got, want, keys, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    """Raise AssertionError naming the first difference between two tables; return None if equal.

    Row and column order are ignored (rows are matched on ``keys``); integer, float and nullable
    types compare by value; NaN/null equals NaN/null. pandas or cuDF frames.
    """
    keys = [keys] if isinstance(keys, str) else list(keys)
    got_cols, want_cols = set(to_pandas(got).columns), set(to_pandas(want).columns)
    if got_cols != want_cols:
        raise AssertionError(f"columns differ: missing {sorted(want_cols - got_cols)}, "
                             f"unexpected {sorted(got_cols - want_cols)}")
    absent = [k for k in keys if k not in want_cols]
    if absent:
        raise AssertionError(f"key columns {absent} are not in the tables")
    g, w = _comparable(got, keys), _comparable(want, keys)
    for name, frame in (("got", g), ("expected", w)):
        duplicated = frame.duplicated(keys)
        if duplicated.any():
            raise AssertionError(f"{name} table has duplicate keys, e.g. {_key_text(frame[duplicated].iloc[0], keys)}")
    g_keys = set(map(tuple, g[keys].astype(object).itertuples(index=False)))
    w_keys = set(map(tuple, w[keys].astype(object).itertuples(index=False)))
    if g_keys != w_keys:
        missing, extra = sorted(w_keys - g_keys, key=str), sorted(g_keys - w_keys, key=str)
        raise AssertionError(f"rows differ on {keys}: {len(missing)} missing {missing[:5]}, "
                             f"{len(extra)} unexpected {extra[:5]} ({len(g)} rows, expected {len(w)})")
    for name in [c for c in w.columns if c not in keys]:
        a, b = g[name], w[name]
        numeric = a.dtype == "float64" and b.dtype == "float64"
        if numeric:
            bad = ~np.isclose(a.to_numpy(), b.to_numpy(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            bad = ~((a.isna() & b.isna()) | (a.astype(object) == b.astype(object))).to_numpy()
        if bad.any():
            i = int(np.argmax(bad))
            raise AssertionError(f"column {name!r} differs in {int(bad.sum())} of {len(w)} rows; first at "
                                 f"{_key_text(w.iloc[i], keys)}: got {a.iloc[i]!r}, expected {b.iloc[i]!r}"
                                 + (f" (rtol={rtol}, atol={atol})" if numeric else ""))


# ---------------------------------------------------------------------------------------------
# Row loop against vectorised code


def fare_per_km_loop(trips) -> pd.Series:
    """(fare + 2.5 in the evening rush) / distance_km, one Python step per row: the slow reference.

    NaN where distance_km <= 0 or the fare is NaN.
    """
    trips = to_pandas(trips)
    values = []
    for _, row in trips.iterrows():
        if row["distance_km"] <= 0 or pd.isna(row["fare"]):
            values.append(np.nan)
            continue
        surcharge = RUSH_SURCHARGE if RUSH_HOURS[0] <= row["pickup_at"].hour <= RUSH_HOURS[1] else 0.0
        values.append((row["fare"] + surcharge) / row["distance_km"])
    return pd.Series(values, index=trips.index, dtype="float64", name="fare_per_km")


def fare_per_km_ref(trips):
    """:func:`fare_per_km_loop` with whole-column operations (pandas or cuDF)."""
    ### BEGIN SOLUTION
    hour = trips["pickup_at"].dt.hour
    rush = (hour >= RUSH_HOURS[0]) & (hour <= RUSH_HOURS[1])
    per_km = (trips["fare"] + RUSH_SURCHARGE * rush.astype("float64")) / trips["distance_km"]
    return per_km.where(trips["distance_km"] > 0).rename("fare_per_km")
    ### END SOLUTION
