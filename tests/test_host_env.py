"""The environment of what runs course code: the grading child, nbgrader and its kernel. Device and
compiler variables are passed deliberately, by name; an inherited TRITON_INTERPRET never is."""

from pathlib import Path

from autograder.engine import bwrap

HOST = {"TRITON_INTERPRET": "1", "TRITON_DEBUG": "1", "CC": "gcc", "CUDA_VISIBLE_DEVICES": "3",
        "TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas", "LD_LIBRARY_PATH": "/usr/lib/wsl/lib", "AWS_SECRET": "x",
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}


def test_a_gpu_child_gets_the_named_host_variables_and_nothing_else():
    env = bwrap.device_environment(True, HOST)
    assert env == {"CC": "gcc", "CUDA_VISIBLE_DEVICES": "3", "TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas",
                   "LD_LIBRARY_PATH": "/usr/lib/wsl/lib"}
    assert set(env) <= set(bwrap.HOST_VARS)


def test_a_cpu_child_runs_the_interpreter_and_sees_no_gpu_whatever_the_host_says():
    env = bwrap.device_environment(False, HOST)
    assert env["TRITON_INTERPRET"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["CC"] == "gcc" and "TRITON_DEBUG" not in env


def test_the_sandbox_environment_drops_an_inherited_interpreter_switch_on_a_gpu_profile(monkeypatch):
    for var, value in HOST.items():
        monkeypatch.setenv(var, value)
    env = bwrap.environment(gpu=True, home="/job")
    assert "TRITON_INTERPRET" not in env and "TRITON_DEBUG" not in env and "AWS_SECRET" not in env
    assert env["CC"] == "gcc" and env["TRITON_CACHE_DIR"] == "/job/.triton"
    assert bwrap.environment(gpu=False, home="/job")["TRITON_INTERPRET"] == "1"


def test_nbgrader_gets_the_device_variables_of_its_profile_not_the_shells(monkeypatch):
    from autograder.jobs import nbgrader_env

    for var, value in HOST.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/cache/triton")
    env = nbgrader_env(Path("/course/student_package"), {"gpu": True}, isolated=False)
    assert "TRITON_INTERPRET" not in env and "TRITON_DEBUG" not in env
    assert env["CC"] == "gcc" and env["CUDA_VISIBLE_DEVICES"] == "3" and env["TRITON_CACHE_DIR"] == "/cache/triton"
    assert env["FASTDL_GPU"] == "1" and env["FASTDL_UNSAFE_NO_ISOLATION"] == "1"
    cpu = nbgrader_env(Path("/course/student_package"), {"gpu": False}, isolated=True)
    assert cpu["TRITON_INTERPRET"] == "1" and cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["FASTDL_GPU"] == "0"


def _fake_tool(folder: Path, name: str) -> None:
    tool = folder / name
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)


def test_make_tells_a_gpu_host_without_a_c_compiler_how_to_get_one(tmp_path):
    import shutil
    import subprocess

    root = Path(__file__).resolve().parent.parent
    make = shutil.which("make")
    # A GPU host (nvidia-smi answers) whose PATH has no compiler, no apt-get and no root to install one.
    _fake_tool(tmp_path, "nvidia-smi")
    env = {"PATH": str(tmp_path)}
    done = subprocess.run([make, "-s", "c-compiler"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "no C compiler" in done.stdout and "apt-get install gcc" in done.stdout
    _fake_tool(tmp_path, "gcc")
    done = subprocess.run([make, "-s", "c-compiler"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == ""
    # Without a GPU there is nothing to check.
    (tmp_path / "gcc").unlink()
    (tmp_path / "nvidia-smi").unlink()
    done = subprocess.run([make, "-s", "c-compiler"], cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == ""
