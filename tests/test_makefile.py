"""What the Makefile runs: UNSAFE=1 for a self-check without the sandbox, TORCH_INDEX for the install,
a clear stop where the environment cannot be installed (macOS), and installs that say what they do."""

from __future__ import annotations

import os
import stat

import pytest
from make_recipes import dry_run, grader_call, run_make

from autograder import cli

STAMP = ".venv/.installed"


def _grade(*variables: str):
    done = dry_run("grade", "LAB=01", *variables)
    assert done.returncode == 0, done.stderr
    return done.stdout, cli.parser().parse_args(grader_call(done.stdout)[1])


def test_make_grade_passes_unsafe_to_the_check_with_unsafe_1_only():
    recipe, args = _grade("UNSAFE=1")
    assert args.command == "check" and args.lab == "01" and args.unsafe_no_isolation
    # Nothing is installed for a sandbox that is not used.
    assert "bubblewrap" not in recipe
    for variables in ((), ("UNSAFE=0",), ("UNSAFE=",)):
        recipe, args = _grade(*variables)
        assert not args.unsafe_no_isolation, variables
        assert "bubblewrap" in recipe


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_an_unsafe_value_other_than_0_or_1_stops_with_what_to_say(value):
    done = dry_run("grade", "LAB=01", f"UNSAFE={value}")
    assert done.returncode != 0
    assert f"UNSAFE={value}" in done.stderr and "UNSAFE=1" in done.stderr
    assert "-m autograder" not in done.stdout


def _pip_lines(*variables: str) -> list[str]:
    # -W: as if pyproject.toml had just changed, so the install recipe is shown even where .venv is made.
    done = dry_run("-W", "pyproject.toml", STAMP, *variables)
    assert done.returncode == 0, done.stderr
    recipe = done.stdout.replace("\\\n", " ")
    lines = [line for line in recipe.splitlines() if "pip install" in line]
    assert len(lines) == 1, recipe
    return lines[0].split()


def test_torch_index_reaches_pip_as_an_extra_index():
    url = "https://download.pytorch.org/whl/cpu"
    words = _pip_lines(f"TORCH_INDEX={url}")
    assert words[words.index("--extra-index-url") + 1] == url
    assert "--extra-index-url" not in _pip_lines()


def test_on_macos_the_install_stops_before_a_venv_is_made(tmp_path):
    """``uname`` answers Darwin, and the Python the Makefile would make a venv with says so if it is asked to."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "uname").write_text("#!/bin/sh\necho Darwin\n")
    (shims / "python-shim").write_text('#!/bin/sh\n[ "$1" = -m ] && { echo "a venv would be made" >&2; exit 3; }\n'
                                       'exec python3 "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"}
    # A venv of this test's own, so that nothing of the checkout's .venv is touched.
    venv = tmp_path / "venv"
    done = run_make(f"VENV={venv}", "PYTHON=python-shim", f"{venv}/.installed", env=env)
    assert done.returncode != 0
    assert "a venv would be made" not in done.stderr
    assert "macOS" in done.stdout and "WSL2" in done.stdout, done.stdout
    assert not venv.exists()


def test_the_first_install_says_what_it_installs_and_lets_pip_show_its_progress():
    recipe = dry_run("-W", "pyproject.toml", STAMP).stdout.replace("\\\n", " ").splitlines()
    pip = next(i for i, line in enumerate(recipe) if "pip install" in line)
    said = " ".join(recipe[:pip])
    assert "installing the course's Python packages" in said and "GB" in said and "minutes" in said
    assert "--quiet" not in recipe[pip].split() and "-q" not in recipe[pip].split()


@pytest.mark.parametrize("target, package", [("sandbox-tool", "bubblewrap"), ("browser-tool", "chromium")])
def test_an_apt_install_says_what_it_installs_and_shows_apt_at_work(target, package):
    recipe = dry_run(target).stdout
    assert f"installing {package} with apt-get" in recipe
    install = next(line for line in recipe.split(";") if f"apt-get install -y -q {package}" in line)
    assert ">/dev/null" not in install and "-qq" not in install


def test_the_demo_installs_the_course_alone_and_the_suite_adds_its_test_extra(tmp_path):
    # A venv path of this test's own: every stamp is missing there, so each recipe shows its installs.
    venv = tmp_path / "venv"
    demo = dry_run(f"VENV={venv}", "demo").stdout.replace("\\\n", " ")
    installs = [line for line in demo.splitlines() if "pip install" in line]
    assert installs and all("[test]" not in line for line in installs), installs
    suite = dry_run(f"VENV={venv}", "test").stdout.replace("\\\n", " ")
    assert any("pip install" in line and "'.[test]'" in line for line in suite.splitlines()), suite
