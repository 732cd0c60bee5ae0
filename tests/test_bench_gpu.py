"""make bench-gpu on any host: its arithmetic and parsing with made-up inputs, its CPU-host answer,
and that it runs from the source tree with nothing but torch, Triton and NumPy (PYTHONPATH=.)."""

import importlib.util
import json
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def test_threshold_is_the_median_less_the_margin_rounded_down():
    proposal = gpu.propose_threshold([1.70, 1.57, 1.60], margin=0.4)
    assert proposal["median"] == 1.6
    assert proposal["proposed_min_speedup"] == 0.96
    assert proposal["spread"] == round(1.70 / 1.57, 4) and not proposal["noisy"]
    # 0.7 x 0.6 is 0.42 exactly, whatever floating point makes of it; 0.666 x 0.6 = 0.3996 rounds down.
    assert gpu.propose_threshold([0.7], margin=0.4)["proposed_min_speedup"] == 0.42
    assert gpu.propose_threshold([0.666], margin=0.4)["proposed_min_speedup"] == 0.39
    # One disturbed run of three moves the median not at all.
    assert gpu.propose_threshold([2.0, 2.0, 0.5], margin=0.5)["proposed_min_speedup"] == 1.0
    assert gpu.propose_threshold([1.0, 1.3], margin=0.0)["noisy"]
    assert "note" not in proposal and "too slow" in gpu.propose_threshold([0.004], margin=0.4)["note"]


@pytest.mark.parametrize("speedups, margin", [([], 0.4), ([1.0, 0.0], 0.4), ([float("nan")], 0.4),
                                              ([1.0], 1.0), ([1.0], -0.1)])
def test_threshold_refuses_what_cannot_be_calibrated(speedups, margin):
    with pytest.raises(ValueError):
        gpu.propose_threshold(speedups, margin)


def test_proposal_lists_every_speed_item_with_a_figure_or_the_reason_it_has_none():
    profile = {"name": "h100", "labs": {
        "01_gemm": {"matmul": {"cases": 3}, "matmul_speed": {"size": 4096, "min_speedup": 0.45}},
        "08_rapids": {"etl_gpu_speed": {"min_speedup": 2.0}}}}
    proposal = gpu.calibration_proposal(profile, {("01_gemm", "matmul_speed"): [0.66, 0.68, 0.67]},
                                        {("08_rapids", "etl_gpu_speed"): "its grading spec needs cudf"}, 0.4)
    assert proposal["profile"] == "h100" and proposal["margin"] == 0.4 and "0.6" in proposal["rule"]
    gemm = proposal["items"]["01_gemm"]
    assert set(gemm) == {"matmul_speed"}
    assert gemm["matmul_speed"]["current_min_speedup"] == 0.45
    assert gemm["matmul_speed"]["median"] == 0.67 and gemm["matmul_speed"]["proposed_min_speedup"] == 0.4
    assert proposal["items"]["08_rapids"]["etl_gpu_speed"] == {"current_min_speedup": 2.0,
                                                               "not_calibrated": "its grading spec needs cudf"}
    json.dumps(proposal)  # written as is


def test_gpu_state_is_parsed_from_nvidia_smi_csv():
    line = "NVIDIA H100 80GB HBM3, 580.95.05, 1980, 1980, 2619, 2619, 700.00, 41, P0"
    state = gpu.parse_gpu_state(line)
    assert state["gpu_name"] == "NVIDIA H100 80GB HBM3" and state["gpu_driver_version"] == "580.95.05"
    assert state["gpu_clocks_sm"] == "1980" and state["gpu_clocks_max_mem"] == "2619" and state["gpu_pstate"] == "P0"
    with pytest.raises(ValueError, match="fields"):
        gpu.parse_gpu_state("NVIDIA H100, 580.95.05")


def test_reference_cells_are_read_from_the_jupytext_source(tmp_path):
    lab = tmp_path / "99_x.py"
    lab.write_text('# %% [markdown]\n# prose\n\n# %% nbgrader={"grade_id": "k", "solution": true}\n'
                   "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n\n"
                   '# %% nbgrader={"grade_id": "t", "grade": true, "points": 1}\nassert f() == 1\n')
    assert gpu.reference_cells(lab) == {"k": "def f():\n    return 1\n"}


def test_every_speed_item_of_the_gpu_profiles_finds_its_reference_cells():
    specs, _ = gpu._lab_specs()
    for name in ("h100", "a100"):
        profile = json.loads((ROOT / "autograder" / "profiles" / f"{name}.json").read_text())
        for lab, items in profile["labs"].items():
            speed = {i for i, params in items.items() if "min_speedup" in params}
            cells = gpu.reference_cells(ROOT / "labs" / f"{lab}.py")
            for item in specs[lab].items:
                if item.name in speed:
                    assert set(item.cells) <= set(cells), (name, lab, item.name)


def test_every_technique_benchmark_is_run_headline_kernels_first():
    names = gpu.technique_benchmarks()
    assert names[:4] == ["gemm", "attention", "softmax", "layernorm"]
    assert {"grading", "gpu", "_runner"}.isdisjoint(names)
    assert set(names) == {p.stem for p in (ROOT / "benchmarks").glob("*.py")
                          if re.search(r"^from _runner import", p.read_text(), re.M)}


def test_the_gpu_tests_are_the_marked_ones_and_every_kernel_test_that_picks_the_gpu():
    files = gpu.gpu_test_files()
    assert {"tests/test_custom.py", "tests/test_gemm.py", "tests/test_attention.py", "tests/test_softmax.py",
            "tests/test_layernorm.py"} <= set(files)
    # Tests that never touch a GPU stay out of a ten-minute run.
    assert "tests/test_grading_pipeline.py" not in files and "tests/test_bench_gpu.py" not in files


def test_the_package_admits_python_3_11_to_3_13():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11,<3.14"


# What a GPU image is not assumed to have; bench-gpu imports none of it.
NOT_ON_A_GPU_IMAGE = ["nbgrader", "nbformat", "nbclient", "jupytext", "jupyter_client", "pandas", "matplotlib",
                      "sklearn", "pyarrow", "dask", "yaml", "pytest"]


def test_bench_gpu_runs_from_the_source_tree_and_says_a_cpu_host_needs_a_gpu():
    """No site processing (-S): the editable install's path hook is not read, so the package comes
    from PYTHONPATH=<source tree> alone, beside the site-packages that hold torch and Triton. What
    the GPU path imports (the grading engine, every lab's spec) must need nothing a GPU image lacks."""
    from fastdl_lab import device

    if device.has_gpu():
        pytest.skip("checks the CPU-host answer")
    code = ("import sys; root = sys.argv[1]; sys.path.insert(0, root + '/benchmarks'); import gpu; "
            "rc = gpu.main([]); import fastdl_lab; import autograder.engine.grade; "
            # What calibration imports on a GPU host: every lab's grading spec.
            "specs, missing = gpu._lab_specs(); assert not missing, missing; "
            "assert fastdl_lab.__file__.startswith(root + '/'), fastdl_lab.__file__; "
            f"print('leaked', sorted({{m.split('.')[0] for m in sys.modules}} & set({NOT_ON_A_GPU_IMAGE!r}))); "
            "sys.exit(rc)")
    paths = dict.fromkeys([str(ROOT), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(paths)}
    done = subprocess.run([sys.executable, "-S", "-c", code, str(ROOT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs a GPU" in done.stdout
    assert "leaked []" in done.stdout, done.stdout


def test_make_bench_gpu_succeeds_on_a_cpu_host_without_the_venv():
    from fastdl_lab import device

    if device.has_gpu():
        pytest.skip("checks the CPU-host answer")
    # BIN pointing nowhere is a checkout without .venv: the target falls back to $(PYTHON).
    done = subprocess.run(["make", "-s", "bench-gpu", "BIN=/nonexistent", f"PYTHON={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "needs a GPU" in done.stdout


def test_each_step_is_recorded_with_the_gpus_clocks(tmp_path, monkeypatch):
    line = "NVIDIA H100 80GB HBM3, 580.95.05, 1755, 1980, 2619, 2619, 700.00, 63, P0"
    monkeypatch.setattr(gpu, "RESULTS", tmp_path)
    monkeypatch.setattr(gpu, "gpu_state", lambda: gpu.parse_gpu_state(line))
    gpu.record_step("tests", "ok", 12.34, "1 passed")
    gpu.record_step("benchmark gemm", "timeout", 150.0)
    import csv

    rows = list(csv.DictReader((tmp_path / "gpu_runs.csv").open()))
    assert [r["step"] for r in rows] == ["tests", "benchmark gemm"]
    assert rows[0]["gpu_clocks_sm"] == "1755" and rows[0]["gpu_clocks_max_sm"] == "1980"
    assert rows[0]["gpu_driver_version"] == "580.95.05" and rows[0]["seconds"] == "12.3"
    assert rows[1]["status"] == "timeout"
