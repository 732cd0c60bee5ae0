import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# The processes the tests start (nbgrader, its kernel manager, notebook kernels) import this
# checkout's packages, not those of whichever clone the virtual environment was installed from.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))

# Keep every cache inside the project even when pytest is run directly rather than through make.
_CACHE = _ROOT / "build" / "cache"
for _var, _sub in {
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "JUPYTER_RUNTIME_DIR": "jupyter/runtime",
    "JUPYTER_DATA_DIR": "jupyter/data",
    "JUPYTER_CONFIG_DIR": "jupyter/config",
    "IPYTHONDIR": "ipython",
    "MPLCONFIGDIR": "matplotlib",
}.items():
    os.environ.setdefault(_var, str(_CACHE / _sub))
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def course(tmp_path_factory):
    """One built course (every lab's source, release and student package) for the whole session."""
    from autograder.course import Course, build

    course = Course(tmp_path_factory.mktemp("course"))
    build(course)
    return course


@pytest.fixture(scope="session")
def cpu():
    from autograder import profiles

    return profiles.load("cpu")
