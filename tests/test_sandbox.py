"""Every way a child can misbehave ends in one named status, and nothing is left running."""

import os
import sys
from pathlib import Path

import pytest

from autograder.engine.items import Built
from autograder.engine.sandbox import Limits, run_sandboxed

LIMITS = Limits(wall_s=4, cpu_s=8, memory_bytes=1 << 30, max_processes=8, output_bytes=10_000)

CASES = {
    "ok": ("print('hello')", "ok"),
    "abort": ("import os; os.abort()", "crashed"),
    "segfault": ("import ctypes; ctypes.string_at(0)", "crashed"),
    "loop": ("while True: pass", "timeout"),
    "flood": ("while True: print('x' * 100)", "output"),
    "fork": ("import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n        time.sleep(60)\ntime.sleep(60)", "processes"),
    "memory": ("x = bytearray(2 << 30)", "memory"),
    "exit_code": ("raise SystemExit(4)", "error"),
}


@pytest.mark.parametrize("name", CASES)
def test_named_status(name, tmp_path):
    code, status = CASES[name]
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    assert result.status == status, (result.status, result.reason, result.output_tail[-500:])
    assert (result.reason == "") == (status == "ok")


def _running(marker):
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    alive.append(pid)
        except OSError:
            pass
    return alive


def test_the_processes_a_child_starts_are_counted(tmp_path):
    code = "import subprocess, time\nprocs = [subprocess.Popen(['sleep', '0.5']) for _ in range(2)]\n[p.wait() for p in procs]"
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    assert result.ok and result.processes == 3, result.processes


def test_nothing_left_running(tmp_path):
    marker = "fastdl-sandbox-orphan-check"
    code = f"import os, time\nif os.fork() == 0:\n    os.execvp('sleep', ['sleep', '60', '{marker}'])\ntime.sleep(60)"
    result = run_sandboxed([sys.executable, "-c", code], limits=Limits(wall_s=2), cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    assert result.status == "timeout"
    assert _running(marker) == []


def test_a_process_that_leaves_the_session_is_killed_too(tmp_path):
    marker = "fastdl-sandbox-escape-check"
    code = (
        "import os, subprocess\n"
        f"subprocess.Popen(['sleep', '60', '{marker}'], start_new_session=True)\n"
    )
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    if not result.jailed:
        pytest.skip("no writable pids cgroup: only the session is cleaned up on this OS")
    assert result.status == "ok"
    assert _running(marker) == []


def test_network_is_isolated_where_allowed(tmp_path):
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)"
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    if not result.network_isolated:
        pytest.skip("this OS does not let the grader unshare the network namespace")
    assert result.status == "error"
    assert "unreachable" in result.output_tail or "refused" in result.output_tail


def test_loopback_only_when_asked(tmp_path):
    code = (
        "import socket\n"
        "server = socket.create_server(('127.0.0.1', 0))\n"
        "client = socket.create_connection(server.getsockname(), timeout=2)\n"
        "print('connected')\n"
    )
    env = {"PATH": os.environ["PATH"]}
    closed = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env=env)
    if not closed.network_isolated:
        pytest.skip("this OS does not let the grader unshare the network namespace")
    assert closed.status == "error"
    opened = run_sandboxed([sys.executable, "-c", code], limits=Limits(wall_s=10, loopback=True), cwd=str(tmp_path), env=env)
    assert opened.status == "ok" and "connected" in opened.output_tail


def test_compiler_caches_are_private_to_the_work_directory():
    from autograder.engine import bwrap

    env = bwrap.environment(gpu=False, home="/job")
    assert env["TRITON_CACHE_DIR"].startswith("/job/") and env["TORCH_EXTENSIONS_DIR"].startswith("/job/")


def test_an_item_that_builds_gets_more_time_only_for_itself():
    from autograder import profiles
    from autograder.engine.grade import _item_limits
    from autograder.engine.items import Item

    profile = profiles.load("cpu")
    plain = _item_limits(Item("plain", 1.0, (), lambda seed, params: {}), profile)
    builds = _item_limits(Item("builds", 1.0, (), lambda seed, params: {}, build_s=60), profile)
    assert builds.wall_s == plain.wall_s + 60 and builds.cpu_s == plain.cpu_s + 120
    assert builds.memory_bytes == plain.memory_bytes
    # An item built by a build child of its own: that child gets the build's time, the student's
    # child, which only loads what was built, does not.
    built = Item("built", 1.0, (), lambda seed, params: {}, build_s=60, built=Built("SRC", print, print))
    assert _item_limits(built, profile).wall_s == plain.wall_s
    assert _item_limits(built, profile, building=True).wall_s == plain.wall_s + 60


def test_a_built_items_children_get_no_code_of_the_students_only_the_approved_files(tmp_path):
    import json

    from autograder.engine.grade import _Workdir
    from autograder.engine.items import Item, LabSpec

    item = Item("built", 1.0, ("cell",), lambda seed, params: {}, built=Built("SRC", print, print))
    lab = LabSpec("99_test", [item])
    cells = {"cell": 'import os\nos.system("x")\nSRC = "int a;"\n'}
    build = _Workdir(lab, item, cells, {"source": "int a;"}, mode="build", params={}, within=tmp_path)
    run = _Workdir(lab, item, cells, {}, mode="check", params={}, within=tmp_path, built={"x.so": b"\x7fELF"})
    try:
        for work in (build, run):
            job = json.loads(Path(work.path, "job.json").read_text())
            assert job["cells"] == [] and "artefact_module" not in job and "kernel_module" not in job
            assert not list(Path(work.path).glob("cell_*"))
        assert json.loads(Path(run.path, "job.json").read_text())["built"] == {"x.so": "built/x.so"}
        shipped = Path(run.path, "built", "x.so")
        assert shipped.read_bytes() == b"\x7fELF" and oct(shipped.stat().st_mode & 0o777) == "0o644"
        with pytest.raises(ValueError, match="plain name"):
            _Workdir(lab, item, cells, {}, mode="check", params={}, within=tmp_path, built={"../x.so": b""})
    finally:
        build.remove()
        run.remove()


def _memory_cgroup() -> bool:
    from autograder.engine.jail import Jail

    jail = Jail.create()
    try:
        return jail is not None and jail.peak_bytes() is not None
    finally:
        if jail is not None:
            jail.kill_all()


needs_memory_cgroup = pytest.mark.skipif(not _memory_cgroup(), reason="no writable memory cgroup on this OS")


@needs_memory_cgroup
def test_the_memory_peak_is_the_kernels_and_counts_every_process_and_tmpfs_page(tmp_path):
    # 200 MB held for an instant in a thread of a child process, and 100 MB in a file of a tmpfs:
    # the watchdog's samples, 50 ms apart, may miss the first; the cgroup's peak does not.
    code = ("import os, threading, time\n"
            "def burst():\n    b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])\n"
            "if os.fork() == 0:\n    t = threading.Thread(target=burst); t.start(); t.join(); os._exit(0)\n"
            "os.wait()\n")
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    assert result.ok and result.peak_source == "cgroup"
    assert result.peak_bytes >= 200 << 20


@needs_memory_cgroup
def test_a_spike_past_the_limit_is_stopped_by_the_kernel_and_named(tmp_path):
    from autograder.engine import sandbox

    # Over the watchdog's limit and the kernel's (limit + slack) within one sample's time.
    size = LIMITS.memory_bytes + sandbox.CGROUP_SLACK_BYTES + (256 << 20)
    code = f"b = bytearray({size}); b[::4096] = b'x' * len(b[::4096])"
    limits = Limits(wall_s=20, cpu_s=20, memory_bytes=LIMITS.memory_bytes, limit_address_space=False)
    result = run_sandboxed([sys.executable, "-c", code], limits=limits, cwd=str(tmp_path), env={"PATH": os.environ["PATH"]})
    assert result.status == "memory", (result.status, result.reason)


def test_a_frozen_child_makes_no_progress_until_thawed(tmp_path):
    import threading
    import time

    from autograder.engine.jail import Jail

    jails = []
    out = tmp_path / "count"
    # Each count replaces the file whole: a freeze never finds it half written.
    code = (f"import os, time\nn = 0\nend = time.monotonic() + 3\n"
            f"while time.monotonic() < end:\n    n += 1\n    open({str(out)!r} + '.new', 'w').write(str(n))\n"
            f"    os.replace({str(out)!r} + '.new', {str(out)!r})\n")
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("r", run_sandboxed(
        [sys.executable, "-c", code], limits=Limits(wall_s=20), cwd=str(tmp_path), env={"PATH": os.environ["PATH"]},
        started=jails.append)))
    thread.start()
    while not out.exists():
        time.sleep(0.01)
    jail: Jail | None = jails[0]
    if jail is None or not jail.freeze(True):
        jail and jail.freeze(False)
        thread.join()
        pytest.skip("no cgroup freezer on this OS")
    time.sleep(0.1)
    frozen_at = out.read_text()
    time.sleep(0.5)
    assert out.read_text() == frozen_at
    assert jail.freeze(False)
    thread.join()
    assert done["r"].ok and int(out.read_text()) > int(frozen_at)
