import dataclasses
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fastdl_lab import device


@pytest.fixture
def cpu_only():
    if device.has_gpu():
        pytest.skip("checks the CPU-only behaviour")


def test_import_turns_the_interpreter_on_without_a_gpu(cpu_only):
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert device.interpreting()
    assert device.enable_interpreter_if_no_gpu()


def test_an_explicit_choice_of_interpreter_is_kept(cpu_only, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not device.enable_interpreter_if_no_gpu()
    assert os.environ["TRITON_INTERPRET"] == "0"


@pytest.mark.parametrize("value, quick", [("1", True), ("yes", True), (" On ", True), ("0", False), ("", False),
                                          (None, False)])
def test_quick_mode_is_read_from_the_environment(monkeypatch, value, quick):
    if value is None:
        monkeypatch.delenv(device.QUICK_VAR, raising=False)
    else:
        monkeypatch.setenv(device.QUICK_VAR, value)
    assert device.quick() is quick


def test_cpu_facts(cpu_only):
    info = device.info()
    assert info.kind == "cpu"
    assert info.sm_count is None and info.driver is None and info.capability is None
    assert info.cpu_count >= 1 and info.memory_bytes > 0
    assert info.torch_version == torch.__version__
    assert info.as_dict()["kind"] == "cpu"
    assert device.profile_name() == "cpu"
    assert device.datasheet_peak() is None
    device.synchronize()


def test_harness_modules_do_not_import_triton():
    code = ("import sys; from fastdl_lab import checks, device, timing; device.describe(); "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
])
def test_datasheet_peak_matches_device_names(name, key):
    assert device.datasheet_peak(name) is device.PEAKS[key]


@pytest.mark.parametrize("name", ["NVIDIA L40S", "NVIDIA GH200 480GB", "NVIDIA RTX A1000",
                                  "NVIDIA GeForce RTX 4090", "AMD Instinct MI300X"])
def test_datasheet_peak_is_none_for_other_devices(name):
    assert device.datasheet_peak(name) is None


def test_peaks_are_consistent():
    for key, peak in device.PEAKS.items():
        assert peak.fp16_tflops > peak.fp32_tflops > 0, key
        assert peak.mem_bw_gbs > 0 and peak.memory_gb > 0 and peak.l2_mb > 0, key
    assert device.PEAKS["t4"].bf16_tflops is None and device.PEAKS["t4"].tf32_tflops is None
    assert device.PEAKS["h200"].mem_bw_gbs > device.PEAKS["h100"].mem_bw_gbs


def test_roofline_ridge_point():
    roof = device.Roofline(bandwidth_gbs=2000.0, tflops=100.0, dtype=torch.float16,
                           source="datasheet", device="test")
    assert roof.ridge_intensity == pytest.approx(50.0)
    assert roof.attainable_tflops(10.0) == pytest.approx(20.0)
    assert roof.attainable_tflops(50.0) == pytest.approx(100.0)
    assert roof.attainable_tflops(1000.0) == pytest.approx(100.0)


def test_datasheet_roofline():
    roof = device.datasheet_roofline("NVIDIA A100-SXM4-80GB", torch.bfloat16)
    assert (roof.tflops, roof.bandwidth_gbs, roof.source) == (312.0, 2039.0, "datasheet")
    assert device.datasheet_roofline("Tesla T4", torch.bfloat16) is None
    assert device.datasheet_roofline("unknown GPU") is None


def test_measure_roofline_gives_positive_finite_figures():
    roof = device.measure_roofline(copy_bytes=8 << 20, matmul_n=256, reps=2)
    assert roof.source == "measured" and roof.dtype == torch.float32
    for value in (roof.bandwidth_gbs, roof.tflops, roof.ridge_intensity):
        assert math.isfinite(value) and value > 0


def test_describe_summarises_the_machine():
    text = device.describe()
    info = device.info()
    assert info.name in text and info.torch_version in text
    assert "interpreter ON" in text or not device.interpreting()
    assert device.profile_name() in text


@pytest.mark.skipif(not device.interpreting(), reason="the interpreter's dtype gate; a GPU compiles instead")
def test_kernel_tensor_gate_names_the_problem():
    device.check_kernel_tensor(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="not supported"):
        device.check_kernel_tensor(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="bfloat16"):
        device.check_kernel_tensor(torch.zeros(2, dtype=torch.bfloat16))
    assert device.TRITON_TYPES[torch.float32] == "fp32"


# Host set-up: what a GPU host lacks, judged from facts given as arguments.
GPU_HOST = device.HostFacts(torch_gpu=True, driver="580.95.05", torch_cuda="13.0", c_compiler="/usr/bin/gcc",
                            triton_interpret=None, triton="3.6.0")


def test_a_ready_gpu_host_and_a_plain_cpu_host_lack_nothing():
    assert device.host_problems(GPU_HOST) == []
    cpu = device.HostFacts(torch_gpu=False, driver=None, torch_cuda=None, c_compiler=None,
                           triton_interpret="1", triton="3.7.1")
    assert device.host_problems(cpu) == []


@pytest.mark.parametrize("change, expected", [
    ({"triton_interpret": "1"}, "TRITON_INTERPRET=1 although a GPU is present"),
    ({"triton_interpret": " True "}, "unset it"),
    ({"c_compiler": None}, "no C compiler"),
    ({"triton": None}, "Triton is not installed"),
    ({"torch_gpu": False, "driver": "575.51.03"}, "driver 575.51.03 is too old for torch built with CUDA 13.0 "
                                                  "(needs 580.65.6"),
    ({"torch_gpu": False, "driver": "535.104.05", "torch_cuda": "12.8"}, "torch sees no GPU"),
    ({"torch_gpu": False, "torch_cuda": None}, "torch is a CPU build"),
])
def test_a_gpu_host_is_told_what_it_lacks(change, expected):
    problems = device.host_problems(dataclasses.replace(GPU_HOST, **change))
    assert len(problems) == 1 and expected in problems[0], problems


def test_interpreter_off_is_no_problem_on_a_gpu_host():
    assert device.host_problems(dataclasses.replace(GPU_HOST, triton_interpret="0")) == []


def test_triton_interpreter_runs_the_probe_kernel_here():
    from fastdl_lab import interpreter_probe

    assert interpreter_probe.run(5) == [0, 1, 2, 3, 4]
    assert device.interpreter_problem() is None
    assert "MISSING" not in device.describe()


@pytest.mark.parametrize("triton, numpy, broken", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.5.0", True), ("3.5.1", "3.0.1", True),
    ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.10.0", "2.4.0", False), (None, "2.4.0", False),
])
def test_the_known_broken_triton_and_numpy_are_named_from_their_versions(triton, numpy, broken):
    problem = device.known_interpreter_problem(triton, numpy)
    assert (problem is not None) == broken
    if broken:
        assert f"Triton {triton} with NumPy {numpy}" in problem and "numpy<2.4" in problem


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_describe_names_a_broken_interpreter_only_where_it_runs_the_kernels(monkeypatch, interpret):
    # A GPU host that compiles its kernels does not need the interpreter (make bench-gpu runs there).
    versions = {"triton": "3.6.0", "numpy": "2.4.6"}
    monkeypatch.setattr(device, "_package_version", lambda name: versions.get(name))
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    shown = "MISSING   Triton 3.6.0 with NumPy 2.4.6: Triton's interpreter" in device.describe()
    assert shown == (interpret == "1")
    assert not any("Triton's interpreter" in p for p in device.host_problems(device.host_facts()))


def test_an_interpreter_that_raises_on_an_argument_bound_loop_is_named_with_its_fix(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    def numpy_2_4_refuses(self, *args, **kwargs):
        # What Triton 3.6's interpreter raises under NumPy 2.4 (triton-lang/triton#9171).
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(InterpretedFunction, "run", numpy_2_4_refuses)
    device.interpreter_problem.cache_clear()
    try:
        problem = device.interpreter_problem()
        assert "fails on a loop whose bound is an argument" in problem
        assert "only 0-dimensional arrays" in problem and "numpy<2.4" in problem
        with pytest.raises(device.InterpreterBroken, match="triton-lang/triton#9171"):
            device.check_interpreter()
    finally:
        device.interpreter_problem.cache_clear()


def test_the_c_compiler_is_found_as_triton_finds_it(monkeypatch):
    assert device.find_c_compiler({"CC": "no-such-compiler-here -O2"}) is None
    assert device.find_c_compiler({"CC": "sh -c"}) == shutil.which("sh")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert device.find_c_compiler({}) is None


def test_describe_names_what_is_missing(monkeypatch):
    facts = dataclasses.replace(GPU_HOST, torch_gpu=False, driver="470.57.02", torch_cuda="12.1")
    monkeypatch.setattr(device, "host_facts", lambda: facts)
    assert "MISSING   driver 470.57.02 is too old" in device.describe()
