"""Past one device: the same ETL on ``dask.dataframe`` across worker processes.

Here the partitions are pandas frames, so this is "more CPU processes", not "more GPUs". On a GPU
host with ``dask_cudf`` installed, the same graph over ``dask_cudf.read_parquet`` partitions runs
one cuDF worker per GPU (``dask_cuda.LocalCUDACluster``); that route is not exercised here.
"""

from __future__ import annotations

import contextlib

import pandas as pd

from fastdl_lab.tabular.etl import KEYS, prepare_trips

CLOSE_TIMEOUT_S = 20


@contextlib.contextmanager
def dask_cluster(n_workers: int = 2, timeout: float = CLOSE_TIMEOUT_S, *, processes: bool = True):
    """A local cluster of ``n_workers`` single-threaded worker processes and a Client on it.

    Both are closed on the way out, also when the block raises: a leaked cluster keeps its worker
    processes (and their memory) alive until the interpreter exits. ``processes=False`` runs the
    scheduler and workers as threads of this process: the same graph, the same scheduler and the
    same answer, without the 3-4 s a worker process takes to start and import pandas.

    Either way the cluster speaks TCP on loopback. Threads would otherwise talk over ``inproc://``,
    whose addresses name the host's outward address: where there is no route out (the grader's
    sandbox) finding it fails with a warning on standard error.
    """
    from distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=processes,
                           protocol="tcp://", host="127.0.0.1", dashboard_address=None, silence_logs=40)
    try:
        client = Client(cluster, timeout=timeout)
        try:
            yield client
        finally:
            client.close(timeout=timeout)
    finally:
        cluster.close(timeout=timeout)


def _with_card_flag(rows):
    # Integer flags so that per-partition sums add up exactly.
    return rows.assign(card=(rows["payment"] == "card").astype("int64"))


def etl_dask_compute(paths, zones: pd.DataFrame, prepare=None) -> pd.DataFrame:
    """The ETL as a Dask graph, computed on the current scheduler (a Client, if one is active).

    A mean of partition means is wrong when partitions differ in size, so each partition reports
    sums and counts, Dask adds those up per key, and the means are divided out at the end.
    """
    import dask
    import dask.dataframe as dd

    prepare = prepare or prepare_trips
    trips = dd.read_parquet(paths)
    # zones is small: every partition gets the whole table and joins locally (a broadcast join).
    rows = trips.map_partitions(lambda part: _with_card_flag(prepare(part, zones)))
    groups = rows.groupby(KEYS)
    sums, counts = dask.compute(groups[["fare", "distance_km", "passengers", "card"]].sum(),
                                groups[["trip_id", "passengers"]].count())
    table = pd.DataFrame({
        "trips": counts["trip_id"],
        "mean_fare": sums["fare"] / counts["trip_id"],
        "mean_distance_km": sums["distance_km"] / counts["trip_id"],
        # Null passenger counts are not counted, so they do not pull the mean towards zero.
        "mean_passengers": sums["passengers"] / counts["passengers"].where(counts["passengers"] > 0),
        "card_share": sums["card"] / counts["trip_id"],
    })
    return table.reset_index().sort_values(KEYS).reset_index(drop=True)


def etl_dask(paths, zones: pd.DataFrame, n_workers: int = 2, prepare=None, *, processes: bool = True) -> pd.DataFrame:
    """:func:`etl_ref` over Parquet files (a list or a glob) on a fresh local cluster of
    ``n_workers`` processes (threads with ``processes=False``); returns a pandas table.

    ``prepare`` replaces the row-wise steps (default :func:`prepare_trips`), so a lab can pass a
    student's version; it runs inside the workers, on one pandas partition at a time.
    """
    with dask_cluster(n_workers, processes=processes):
        return etl_dask_compute(paths, zones, prepare)
