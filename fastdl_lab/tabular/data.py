"""A taxi-trip-like dataset with the shape and the mess of real trip records.

Zone popularity is Zipf-skewed (a handful of zones take most pickups, as airports and midtown do),
trips bunch at rush hours, and the columns carry the faults an ETL must survive: null fares, zero
and negative distances, dropoffs before pickups, null passenger counts, zone keys that the zones
table does not know, and payment types spelt five ways. Tips follow payment, hour and distance
with noise; cash tips are almost never recorded, as in real taxi data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fastdl_lab.tabular.backend import Backend

BOROUGHS = ("Manhattan", "Brooklyn", "Queens", "Bronx", "Staten Island", "EWR")
_BOROUGH_WEIGHTS = (0.3, 0.25, 0.25, 0.12, 0.06, 0.02)
_PLACES = ("Heights", "Park", "Square", "Village", "Hill", "Yards", "Point", "Harbor", "Gardens", "Flats")
# Relative pickups per hour of day: a morning and a stronger evening rush, a quiet night.
_HOUR_WEIGHTS = np.array([0.6, 0.4, 0.3, 0.2, 0.2, 0.4, 1.0, 1.8, 2.2, 1.6, 1.2, 1.2,
                          1.3, 1.3, 1.4, 1.6, 2.0, 2.4, 2.4, 2.0, 1.6, 1.4, 1.2, 0.9])
# How each payment type is spelt in the raw records.
_SPELLINGS = {"card": ["card", "Card", " Card", "CARD", "card "],
              "cash": ["cash", "Cash", "cash ", " CASH"],
              "other": ["unknown", "dispute", "No Charge", " unknown"]}
MONTH_START = np.datetime64("2024-03-01T00:00:00", "s")
MONTH_DAYS = 31
RUSH_HOURS = (16, 19)  # the evening surcharge window, inclusive


def make_zones(n_zones: int = 263, seed: int = 0, missing: int = 3) -> pd.DataFrame:
    """Zones ``1..n_zones`` less ``missing`` ids, so some trip keys find no zone."""
    rng = np.random.default_rng([seed, 1])
    ids = np.arange(1, n_zones + 1)
    ids = np.setdiff1d(ids, rng.choice(ids, missing, replace=False))
    borough = rng.choice(len(BOROUGHS), len(ids), p=_BOROUGH_WEIGHTS)
    names = [f"{_PLACES[p]} {i}" for p, i in zip(rng.integers(len(_PLACES), size=len(ids)), ids)]
    return pd.DataFrame({"zone_id": ids.astype("int64"), "borough": np.array(BOROUGHS)[borough],
                         "zone_name": names})


def _zone_keys(rng, n: int, n_zones: int) -> np.ndarray:
    # Two keys past the table's range stand for "outside the city" codes of real records.
    keys = np.arange(1, n_zones + 3)
    popularity = 1.0 / np.arange(1, len(keys) + 1) ** 1.1
    return rng.choice(rng.permutation(keys), n, p=popularity / popularity.sum()).astype("int64")


def make_trips(n_rows: int, seed: int = 0, n_zones: int = 263) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(trips, zones)`` as pandas DataFrames; the same seed gives the same frames."""
    rng = np.random.default_rng([seed, 0])
    n = n_rows
    hour = rng.choice(24, n, p=_HOUR_WEIGHTS / _HOUR_WEIGHTS.sum())
    seconds = rng.integers(MONTH_DAYS, size=n) * 86400 + hour * 3600 + rng.integers(3600, size=n)
    pickup = MONTH_START + seconds.astype("timedelta64[s]")

    distance = rng.lognormal(np.log(3.0), 0.75, n)
    fault = rng.random(n)
    distance[fault < 0.01] = 0.0
    distance[(fault >= 0.01) & (fault < 0.013)] *= -1

    rush = (hour >= RUSH_HOURS[0]) & (hour <= RUSH_HOURS[1])
    night = (hour >= 20) | (hour <= 2)
    speed = np.where(rush | ((hour >= 7) & (hour <= 9)), 13.0, np.where(hour <= 5, 30.0, 22.0))
    speed *= rng.lognormal(0.0, 0.2, n)
    minutes = 60 * np.maximum(distance, 0.1) / speed + rng.uniform(1, 4, n)
    late = rng.random(n)
    # Clock faults: a dropoff stamped before the pickup, or at the same second.
    minutes[late < 0.005] = -rng.uniform(1, 30, (late < 0.005).sum())
    minutes[(late >= 0.005) & (late < 0.007)] = 0.0
    dropoff = pickup + (minutes * 60).round().astype("timedelta64[s]")

    fare = 3.0 + 1.55 * np.maximum(distance, 0) + 0.35 * np.maximum(minutes, 0) + 2.5 * rush
    fare = np.maximum(fare + rng.normal(0, 1.0, n), 3.0).round(2)

    kind = rng.choice(3, n, p=[0.62, 0.30, 0.08])
    payment = np.empty(n, dtype=object)
    for k, name in enumerate(_SPELLINGS):
        chosen = kind == k
        payment[chosen] = rng.choice(_SPELLINGS[name], chosen.sum())

    rate = 0.14 + 0.04 * night - 0.02 * rush + 0.02 * np.log(np.clip(distance, 0.5, None)) + rng.normal(0, 0.04, n)
    tipped = np.where(kind == 0, rng.random(n) > 0.12, np.where(kind == 1, rng.random(n) < 0.04, False))
    tip = (np.where(tipped, np.clip(rate, 0, None), 0.0) * fare).round(2)
    fare[rng.random(n) < 0.01] = np.nan

    passengers = pd.array(rng.choice(np.arange(1, 7), n, p=[0.7, 0.14, 0.06, 0.04, 0.03, 0.03]), dtype="Int64")
    passengers[rng.random(n) < 0.02] = pd.NA

    trips = pd.DataFrame({
        "trip_id": np.arange(1, n + 1, dtype="int64"),
        "pickup_at": pd.Series(pickup).astype("datetime64[ns]"),
        "dropoff_at": pd.Series(dropoff).astype("datetime64[ns]"),
        "pickup_zone": _zone_keys(rng, n, n_zones),
        "dropoff_zone": _zone_keys(rng, n, n_zones),
        "passengers": passengers,
        "distance_km": distance.round(3),
        "fare": fare,
        "tip": tip,
        "payment": payment.astype(str),
        "vendor": rng.choice(["CMT", "VTS", "DDS"], n, p=[0.45, 0.5, 0.05]),
    })
    return trips, make_zones(n_zones, seed)


def write_dataset(trips: pd.DataFrame, zones: pd.DataFrame, folder, fmt: str = "parquet",
                  n_files: int = 1) -> tuple[list[Path], Path]:
    """Write ``trips`` as ``n_files`` files of consecutive rows, and ``zones`` beside them.

    Returns ``(trip_paths, zones_path)``. Several files are what Dask reads as partitions.
    """
    if fmt not in ("parquet", "csv"):
        raise ValueError(f"fmt must be 'parquet' or 'csv', not {fmt!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, len(trips), n_files + 1).astype(int)
    paths = [folder / f"trips_{i:03d}.{fmt}" for i in range(n_files)]
    for path, lo, hi in zip(paths, bounds[:-1], bounds[1:]):
        _write(trips.iloc[lo:hi], path, fmt)
    zones_path = folder / f"zones.{fmt}"
    _write(zones, zones_path, fmt)
    return paths, zones_path


def _write(frame: pd.DataFrame, path: Path, fmt: str) -> None:
    if fmt == "parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False)


def read_trips(path, be: Backend):
    """One trips file (CSV or Parquet, by suffix) as a ``be`` frame, with dates parsed."""
    path = Path(path)
    if path.suffix == ".parquet":
        # Parquet keeps the types it was written with, nullable integers included.
        return be.df.read_parquet(path)
    # In CSV an empty field is the only trace of a null: pandas needs its nullable integer type
    # to keep passengers integral; cuDF columns hold nulls natively.
    dtype = {"passengers": "int64" if be.gpu else "Int64"}
    return be.df.read_csv(path, parse_dates=["pickup_at", "dropoff_at"], dtype=dtype)


def read_zones(path, be: Backend):
    path = Path(path)
    return be.df.read_parquet(path) if path.suffix == ".parquet" else be.df.read_csv(path)


def tiny_trips() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Seven hand-made trips whose summary can be worked out on paper (see ``check``)."""
    t = pd.Timestamp("2024-03-04")  # a Monday
    at = lambda h, m: t + pd.Timedelta(hours=h, minutes=m)  # noqa: E731
    trips = pd.DataFrame({
        "trip_id": np.arange(1, 8, dtype="int64"),
        "pickup_at": [at(8, 10), at(8, 20), at(17, 0), at(9, 0), at(9, 5), at(9, 10), at(9, 0)],
        "dropoff_at": [at(8, 30), at(8, 50), at(17, 20), at(9, 30), at(9, 25), at(9, 0), at(9, 15)],
        "pickup_zone": np.array([1, 1, 99, 2, 2, 2, 2], dtype="int64"),
        "dropoff_zone": np.array([2, 2, 1, 1, 1, 1, 1], dtype="int64"),
        "passengers": pd.array([2, None, 1, 1, 1, 1, 3], dtype="Int64"),
        "distance_km": [2.0, 4.0, 5.0, 3.0, 0.0, 2.0, 3.0],
        "fare": [10.0, 20.0, 30.0, np.nan, 8.0, 9.0, 12.0],
        "tip": [2.0, 0.0, 6.0, 0.0, 1.0, 0.0, 0.0],
        "payment": [" Card", "cash ", "CARD", "dispute", "card", "Cash", " unknown"],
        "vendor": ["CMT", "VTS", "VTS", "CMT", "CMT", "VTS", "DDS"],
    })
    zones = pd.DataFrame({"zone_id": np.array([1, 2], dtype="int64"), "borough": ["Manhattan", "Brooklyn"],
                          "zone_name": ["Park 1", "Heights 2"]})
    return trips, zones


# Worked out by hand from tiny_trips: trips 4-6 are dropped (null fare, zero distance, dropoff
# before pickup); trip 3's zone 99 is unknown; trip 2's null passenger count is skipped.
TINY_SUMMARY = pd.DataFrame({
    "borough": ["Brooklyn", "Manhattan", "Unknown"], "hour": [9, 8, 17], "trips": [1, 2, 1],
    "mean_fare": [12.0, 15.0, 30.0], "mean_distance_km": [3.0, 3.0, 5.0],
    "mean_passengers": [3.0, 2.0, 1.0], "card_share": [0.0, 0.5, 1.0]})
