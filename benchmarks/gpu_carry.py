"""The wheels a GPU image lacks for `make gpu-class`, gathered here into a folder a device call carries.

The lent GPU image holds torch, Triton, NumPy, pandas, scikit-learn and much of the scientific
stack, but not the course's grading tools: nbgrader (which builds the course), jupytext, SQLAlchemy
and alembic (the gradebook), the Jupyter libraries they import. It has no registry to install them
from. This script, run here after `make venv`, finds the distributions that the grading path
imports in this checkout's environment (the engine, the batch, the course build and nbgrader's
commands), leaves out those the image already has (``IMAGE_PACKAGES``), and downloads each at the
version installed here as a wheel for the image's Python (CPython 3.12, x86-64 Linux) into
``.dev/wheels`` (ignored by git). It refuses when the folder would not fit a device call.

    python benchmarks/gpu_carry.py            # then carry .dev (with .dev/bwrap from carry-bwrap.sh)

On the GPU host, ``benchmarks/gpu_session.sh`` installs them into the image's Python with
``pip --no-index --no-deps`` and grades the demo class.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEST = ROOT / ".dev" / "wheels"
# What one device call can carry in all (the working tree included); the wheels get most of it.
CARRY_LIMIT_BYTES = 48 << 20
# Modules whose imports make up the grading path of `make gpu-class` without --nbgrader: the
# engine and the batch (benchmarks/gpu_class.py's COURSE_MODULES), the course build, and the
# nbgrader commands the build runs by name (generate_assignment, its database migrations).
GRADING_MODULES = ("autograder.batch", "autograder.submissions", "autograder.progress", "autograder.course",
                   "autograder.engine.grade", "nbgrader.apps.nbgraderapp", "nbgrader.apps.generateassignmentapp",
                   "nbgrader.apps.dbapp", "nbgrader.converters", "alembic.config", "jupytext")
# Distributions of the lent image's Python ('cuda' image, python3 = /opt/torch/.venv, CPython
# 3.12.3), as read there on 2026-11-17: carried again they would replace the image's own versions.
IMAGE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
# The project itself travels as the checkout.
OWN = frozenset({"fastdl-lab"})
# The image's interpreter and machine, for pip's download of binary wheels.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PYTHON_VERSION = "3.12"

_TRACE = """
import importlib, importlib.metadata as md, json, sys
before = set(sys.modules)
for name in sys.argv[1:]:
    importlib.import_module(name)
owners = md.packages_distributions()
found = {}
for module in set(sys.modules) - before:
    for dist in owners.get(module.split(".")[0], []):
        found[dist] = md.version(dist)
print(json.dumps(found))
"""


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(python: str) -> dict[str, str]:
    """{distribution: version} that importing the grading path loads in ``python``'s environment."""
    done = subprocess.run([python, "-c", _TRACE, *GRADING_MODULES], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise SystemExit(f"could not import the grading path with {python}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def to_carry(found: dict[str, str]) -> dict[str, str]:
    """The distributions of ``found`` that the image lacks (alembic's own needs included)."""
    return {name: version for name, version in sorted(found.items())
            if normalise(name) not in IMAGE_PACKAGES | OWN}


def download(wanted: dict[str, str], dest: Path, python: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms,
               "-d", str(dest), *(f"{name}=={version}" for name, version in wanted.items())]
    print(f"downloading {len(wanted)} wheels for CPython {PYTHON_VERSION} into {dest.relative_to(ROOT)} "
          "(about a minute)", flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [ln for ln in done.stderr.splitlines() if "is ignored" not in ln]
        raise SystemExit("pip could not download every wheel:\n" + "\n".join(errors[-20:]))


def _exclude_dev() -> None:
    """git ignores .dev/ here (it holds what a device call carries, never a commit's)."""
    exclude = ROOT / ".git" / "info" / "exclude"
    if not exclude.parent.is_dir():
        return
    if "/.dev/" not in (exclude.read_text(errors="replace").split() if exclude.exists() else []):
        with open(exclude, "a") as f:
            f.write("/.dev/\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                        help="the environment whose grading path is traced (default: .venv's, after make venv)")
    parser.add_argument("--dest", type=Path, default=DEST)
    args = parser.parse_args(argv)
    if not Path(args.python).exists():
        print(f"{args.python} does not exist: run make venv first")
        return 1
    wanted = to_carry(imported_distributions(args.python))
    _exclude_dev()
    download(wanted, args.dest, args.python)
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB: {', '.join(wanted)}")
    if size > CARRY_LIMIT_BYTES:
        print(f"too large to carry with the checkout (at most {CARRY_LIMIT_BYTES >> 20} MiB of wheels)")
        return 1
    print("carry .dev in the device call and start it with: bash benchmarks/gpu_session.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
