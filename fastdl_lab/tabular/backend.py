"""One switch between the GPU stack (cuDF, CuPy, cuML) and the CPU stack (pandas, NumPy, scikit-learn).

Everything else in the lab is written once against the API the two stacks share, and receives a
:class:`Backend` saying which one it runs on.
"""

from __future__ import annotations

import importlib
import importlib.util
import types
from dataclasses import dataclass, field

import numpy

from fastdl_lab import device

ML_NAMES = ("KMeans", "LogisticRegression", "KNeighborsClassifier", "RandomForestClassifier",
            "StandardScaler", "train_test_split", "accuracy_score")


@dataclass(frozen=True)
class Backend:
    name: str
    df: types.ModuleType = field(repr=False)
    np: types.ModuleType = field(repr=False)
    ml: types.SimpleNamespace = field(repr=False)
    gpu: bool
    reason: str


def _cpu(reason: str) -> Backend:
    import pandas
    from sklearn.cluster import KMeans
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score
    from sklearn.model_selection import train_test_split
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.preprocessing import StandardScaler

    ml = types.SimpleNamespace(KMeans=KMeans, LogisticRegression=LogisticRegression,
                               KNeighborsClassifier=KNeighborsClassifier,
                               RandomForestClassifier=RandomForestClassifier, StandardScaler=StandardScaler,
                               train_test_split=train_test_split, accuracy_score=accuracy_score)
    return Backend("pandas", pandas, numpy, ml, gpu=False, reason=reason)


def _why_no_gpu_stack() -> str | None:
    """Why the RAPIDS stack cannot be used here, decided without importing any of it."""
    if not device.has_gpu():
        return "no CUDA device"
    for module in ("cudf", "cupy", "cuml"):
        # find_spec looks at the file system only; importing cudf on a host without a working
        # driver can fail in ways other than ImportError, so we ask before we import.
        if importlib.util.find_spec(module) is None:
            return f"CUDA device but {module} is not installed"
    return None


def _gpu() -> Backend:
    cudf = importlib.import_module("cudf")
    cupy = importlib.import_module("cupy")
    cuml = importlib.import_module("cuml")
    ml = types.SimpleNamespace(
        KMeans=cuml.KMeans, LogisticRegression=cuml.LogisticRegression,
        KNeighborsClassifier=cuml.neighbors.KNeighborsClassifier,
        RandomForestClassifier=cuml.ensemble.RandomForestClassifier,
        StandardScaler=importlib.import_module("cuml.preprocessing").StandardScaler,
        train_test_split=importlib.import_module("cuml.model_selection").train_test_split,
        accuracy_score=importlib.import_module("cuml.metrics").accuracy_score)
    return Backend("cudf", cudf, cupy, ml, gpu=True,
                   reason=f"cudf {cudf.__version__} on {device.info().name}")


def backend(kind: str = "auto") -> Backend:
    """``"auto"``: cuDF/cuML when they work here, else pandas/scikit-learn (``reason`` says why).

    ``"gpu"`` raises RuntimeError instead of falling back; ``"cpu"`` always gives pandas.
    """
    if kind not in ("auto", "gpu", "cpu"):
        raise ValueError(f"kind must be 'auto', 'gpu' or 'cpu', not {kind!r}")
    if kind == "cpu":
        return _cpu("the CPU backend was asked for")
    reason = _why_no_gpu_stack()
    if reason is None:
        try:
            return _gpu()
        # Any exception, not only ImportError: a driver/runtime mismatch raises from inside cudf.
        except Exception as exc:  # noqa: BLE001
            reason = f"CUDA device but importing RAPIDS failed ({type(exc).__name__}: {exc})"
    if kind == "gpu":
        raise RuntimeError(f"no GPU backend: {reason}")
    return _cpu(reason)


def is_gpu_frame(obj) -> bool:
    # By module name, so that asking never imports cudf.
    return type(obj).__module__.split(".")[0] in ("cudf", "cupy")


def day_of_week(datetimes):
    """Monday=0 .. Sunday=6 of a pandas or cuDF datetime series.

    pandas 3.1 deprecates ``.dt.weekday`` for ``.dt.day_of_week``, which cuDF has not always had;
    asking the accessor's class avoids evaluating (and warning on) either name.
    """
    accessor = datetimes.dt
    return accessor.day_of_week if hasattr(type(accessor), "day_of_week") else accessor.weekday


def to_pandas(frame):
    """A pandas copy of a cuDF frame or series; pandas objects are returned as they are."""
    return frame.to_pandas() if is_gpu_frame(frame) else frame


def from_pandas(frame, be: Backend):
    """``frame`` on backend ``be`` (a device copy under cuDF)."""
    return be.df.from_pandas(frame) if be.gpu else frame


def to_numpy(values):
    """A NumPy array from a pandas/cuDF series or frame, a CuPy array, or anything array-like."""
    if is_gpu_frame(values):
        return values.get() if hasattr(values, "get") else values.to_numpy()
    return values.to_numpy() if hasattr(values, "to_numpy") else numpy.asarray(values)
