"""inductor's precompiled header, made once per machine and shown to each notebook kernel: used
there, and never writable by it."""

import hashlib
import os
from pathlib import Path

import pytest

from autograder.engine import bwrap, inductor_headers, kernel_jail
from autograder.engine.sandbox import Limits, run_sandboxed

LIMITS = Limits(wall_s=300, cpu_s=300, memory_bytes=4 << 30, max_processes=32, output_bytes=64_000)


@pytest.fixture(scope="module")
def headers():
    bwrap.check()
    folder = inductor_headers.ensure(kernel_jail.kernel_env(False))
    assert folder is not None
    return folder


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.name.endswith(".gch")}


# A kernel's compile, then what a hostile one would try on the headers it was shown.
KERNEL = """
import os, sys, torch
folder = sys.argv[1]
before = sorted(os.listdir(folder))
torch.compile(lambda x: (x * 2.0 + 1.0).relu().sum())(torch.randn(4096))
print("new headers", sorted(n for n in os.listdir(folder) if n.endswith(".gch") and n not in before))
for name in before:
    if name.endswith(".gch"):
        path = os.path.join(folder, name)
        for attack in (lambda: os.chmod(path, 0o666), lambda: open(path, "r+b").write(b"poison"),
                       lambda: os.unlink(path), lambda: os.rename(path, path + ".old")):
            try:
                attack()
                print("changed", name)
            except OSError as exc:
                print("refused", type(exc).__name__)
"""


def _kernel(tmp_path: Path, headers: Path, name: str):
    work = tmp_path / name
    work.mkdir()
    inside, files = inductor_headers.view(headers)
    assert inside.startswith("/tmp/") and files
    bwrap.prepare_workdir(str(work))
    env = kernel_jail.kernel_env(False)
    view = bwrap.View(str(work), read_only=files, tmp_dirs=(inside,), job_bytes=bwrap.JOB_BYTES)
    return run_sandboxed([bwrap.PYTHON, "-c", KERNEL, inside], limits=LIMITS, cwd=str(work), env=env, view=view)


def test_made_once_and_read_only(headers):
    assert inductor_headers.ensure(kernel_jail.kernel_env(False)) == headers
    gch = [p for p in headers.iterdir() if p.name.endswith(".gch")]
    assert gch and all(p.stat().st_mode & 0o222 == 0 for p in gch)
    if os.geteuid() == 0:
        assert all(p.stat().st_uid == 0 for p in gch)


def test_a_kernel_uses_the_header_and_cannot_change_it_for_the_next(tmp_path, headers):
    original = _digests(headers)
    first = _kernel(tmp_path, headers, "first")
    assert first.status == "ok", first.output_tail[-2000:]
    assert "new headers []" in first.output_tail  # inductor found the header it would have made
    assert "changed" not in first.output_tail and first.output_tail.count("refused") == 4
    assert _digests(headers) == original
    second = _kernel(tmp_path, headers, "second")
    assert second.status == "ok", second.output_tail[-2000:]
    assert "new headers []" in second.output_tail


def test_the_kernel_command_shows_the_headers_where_inductor_looks(tmp_path, headers, monkeypatch):
    started = []

    class Started:
        def __init__(self, argv, **kwargs):
            started.append(argv)

        def wait(self):
            return 0

    package = tmp_path / "package"
    package.mkdir()
    connection = tmp_path / "kernel.json"
    connection.write_text("{}")
    monkeypatch.setattr(kernel_jail.subprocess, "Popen", Started)
    # main() changes the process it runs in: not this one.
    monkeypatch.setattr("autograder.engine.sandbox.die_with_parent", lambda: None)
    monkeypatch.setattr(kernel_jail.signal, "signal", lambda *args: None)
    monkeypatch.setenv(kernel_jail.STUDENT_PACKAGE_VAR, str(package))
    monkeypatch.setenv(inductor_headers.FOLDER_VAR, str(headers))
    assert kernel_jail.main(str(connection)) == 0
    argv = started[0]
    inside = inductor_headers.ready(headers)["inside"]
    at = argv.index(inside)
    # The kernel's own folder is made in its capped /tmp, never on the host's disk.
    assert argv[at - 1] == "--dir" and argv[at - 3:at - 1] == ["--perms", "01777"]
    for header in headers.glob("*.gch"):
        shown = argv.index(f"{inside}/{header.name}")
        assert argv[shown - 2:shown] == ["--ro-bind", str(header)] and shown > at


def test_a_folder_that_was_not_finished_is_not_used(tmp_path):
    assert inductor_headers.ready(tmp_path) is None
    (tmp_path / inductor_headers.WHERE_FILE).write_text('{"inside": "/job/../etc"}')
    assert inductor_headers.ready(tmp_path) is None
    assert inductor_headers.view(tmp_path) is None


def test_a_machine_that_cannot_make_it_tries_once_per_process(tmp_path, monkeypatch, capsys):
    tries = []

    def fails(folder, env, gpu):
        tries.append(folder)
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(inductor_headers, "_make", fails)
    monkeypatch.setattr(inductor_headers, "_FAILED", set())
    assert inductor_headers.ensure({}, root=tmp_path) is None
    assert inductor_headers.ensure({}, root=tmp_path) is None
    assert len(tries) == 1
    assert "no C++ compiler" in capsys.readouterr().err
