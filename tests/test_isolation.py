"""What a sandboxed child can see, write and reach: only its own work directory and what it is given."""

import os
import sys
from pathlib import Path

import pytest

from autograder import jobs
from autograder.course import Course
from autograder.engine import bwrap, kernel_jail
from autograder.engine.sandbox import Limits, run_sandboxed
from fastdl_lab import device

ROOT = Path(__file__).resolve().parent.parent
LIMITS = Limits(wall_s=30, cpu_s=30, memory_bytes=2 << 30, max_processes=8, output_bytes=64_000)


@pytest.fixture(scope="module", autouse=True)
def isolation_works():
    bwrap.check()  # the Makefile installs bubblewrap: a machine without it fails here, loudly


def _sandbox_folder(path):
    path.mkdir()
    bwrap.prepare_workdir(str(path))
    return path


def run(tmp_path, code, *, read_only=None, scratch=None, limits=LIMITS):
    work = _sandbox_folder(tmp_path / "job")
    view = bwrap.View(str(work), read_only=read_only or {}, scratch=scratch or {})
    result = run_sandboxed([sys.executable, "-c", code], limits=limits, cwd=str(work),
                           env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}, view=view)
    return result, work


def test_runs_as_nobody_and_writes_only_its_work_dir(tmp_path):
    code = ("import os; open('/job/out', 'w').write(str(os.getuid()))\n"
            "try:\n    open('/out', 'w')\nexcept OSError as e:\n    print('root refused', type(e).__name__)\n")
    result, work = run(tmp_path, code)
    assert result.status == "ok" and result.sandboxed, result.output_tail
    assert (work / "out").read_text() == str(bwrap.NOBODY)
    assert "root refused" in result.output_tail
    if os.geteuid() == 0:
        assert (work / "out").stat().st_uid == bwrap.NOBODY


@pytest.mark.parametrize("secret", [
    ROOT / "fastdl_lab" / "gemm.py",          # the package with the solutions
    ROOT / "labs" / "01_gemm.py",             # the instructor's notebooks
    ROOT / "autograder" / "engine" / "grade.py",
    Path("/etc/shadow"),
])
def test_cannot_read_what_it_was_not_given(tmp_path, secret):
    result, _ = run(tmp_path, f"open({str(secret)!r}).read()")
    assert result.status == "error"
    assert "FileNotFoundError" in result.output_tail or "PermissionError" in result.output_tail


def test_temporary_files_go_to_its_own_capped_tmp(tmp_path):
    # Not to the work directory on the host's disk, where Python's tempfile falls back when /tmp
    # is not writable.
    code = ("import os, tempfile; f = tempfile.NamedTemporaryFile(); print('at', f.name)\n"
            "s = os.statvfs('/tmp'); print('tmp bytes', s.f_blocks * s.f_frsize)\n"
            "print('mode', oct(os.stat('/tmp').st_mode & 0o7777))")
    result, work = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "at /tmp/" in result.output_tail
    assert f"tmp bytes {bwrap.TMP_BYTES}" in result.output_tail
    assert "mode 0o1777" in result.output_tail
    assert os.listdir(work) == []


def test_its_name_resolves_to_its_own_loopback_and_fonts_are_configured(tmp_path):
    # gloo and torch's TCP store look these up in every rank; fontconfig reads /etc/fonts.
    code = ("import os, socket; print('name', socket.gethostname())\n"
            "print('addr', socket.gethostbyname(socket.gethostname()))\n"
            "print('peer', socket.getnameinfo(('::ffff:127.0.0.1', 1, 0, 0), 0)[0])\n"
            "print('fonts', os.path.isfile('/etc/fonts/fonts.conf'))")
    result, _ = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "name localhost" in result.output_tail and "addr 127.0.0.1" in result.output_tail
    assert "peer localhost" in result.output_tail
    assert f"fonts {os.path.isfile('/etc/fonts/fonts.conf')}" in result.output_tail


def test_a_scratch_folder_is_writable_where_it_is_shown(tmp_path):
    scratch = _sandbox_folder(tmp_path / "scratch")
    code = "open('/tmp/deep/er/folder/made', 'w').write('x'); open('/tmp/deep/beside', 'w').write('y')"
    result, work = run(tmp_path, code, scratch={str(scratch): "/tmp/deep/er/folder"})
    assert result.status == "ok", result.output_tail
    assert (scratch / "made").read_text() == "x"
    with pytest.raises(ValueError, match="/tmp"):
        bwrap.command(["true"], bwrap.View(str(work), scratch={str(scratch): "/job/elsewhere"}))


def test_a_file_bound_read_only_into_a_scratch_folder_cannot_change_even_for_its_owner(tmp_path):
    # A grader that is not root runs the sandbox as its own uid, which owns what it binds in.
    shared = tmp_path / "shared"
    shared.write_bytes(b"original")
    if os.geteuid() == 0:
        os.chown(shared, bwrap.NOBODY, bwrap.NOBODY)
    scratch = _sandbox_folder(tmp_path / "scratch")
    code = ("import os\np = '/tmp/s/shared'\n"
            "for attack in (lambda: os.chmod(p, 0o666), lambda: open(p, 'r+b').write(b'poison'),\n"
            "               lambda: os.unlink(p), lambda: os.rename(p, p + '.x')):\n"
            "    try:\n        attack(); print('changed')\n    except OSError as e:\n        print('refused', e.errno)\n"
            "open('/tmp/s/beside', 'w').write('ok')")
    result, _ = run(tmp_path, code, read_only={str(shared): "/tmp/s/shared"}, scratch={str(scratch): "/tmp/s"})
    assert result.status == "ok", result.output_tail
    assert "changed" not in result.output_tail and result.output_tail.count("refused") == 4
    assert shared.read_bytes() == b"original" and (scratch / "beside").read_text() == "ok"


def test_the_system_files_it_is_given_are_readable(tmp_path):
    # The folders bubblewrap makes for them would otherwise be root-only: torch asks the user
    # database who it is, and Triton asks the linker's cache where libcuda is.
    code = "import os, pwd; print(pwd.getpwuid(os.getuid()).pw_name); print(len(open('/etc/ld.so.cache', 'rb').read()) > 0)"
    result, _ = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "True" in result.output_tail


def test_given_folders_are_read_only(tmp_path):
    given = tmp_path / "pkg"
    given.mkdir()
    (given / "mod.py").write_text("X = 1\n")
    code = "print(open('/opt/pkg/mod.py').read()); open('/opt/pkg/mod.py', 'w').write('X = 2')"
    result, _ = run(tmp_path, code, read_only={str(given): "/opt/pkg"})
    assert "X = 1" in result.output_tail
    assert result.status == "error" and ("Read-only" in result.output_tail or "Permission" in result.output_tail)
    assert (given / "mod.py").read_text() == "X = 1\n"


def test_sees_no_other_process(tmp_path):
    code = "import os; print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    result, _ = run(tmp_path, code)
    pids = eval(result.output_tail.split("pids", 1)[1])
    assert max(pids) < 10, pids  # its own pid namespace: bubblewrap's init and itself


def test_no_network_but_loopback(tmp_path):
    code = ("import socket\n"
            "s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname(), timeout=2)\n"
            "print('loopback ok')\n"
            "socket.create_connection(('1.1.1.1', 53), timeout=2)\n")
    result, _ = run(tmp_path, code)
    assert "loopback ok" in result.output_tail
    assert result.status == "error" and "unreachable" in result.output_tail.lower()


def test_cannot_leave_its_cgroup_or_outlive_the_run(tmp_path):
    marker = f"fastdl-isolation-{os.getpid()}"
    code = ("import os, subprocess\n"
            "try:\n    open('/sys/fs/cgroup/pids/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "except OSError as e:\n    print('cgroup refused', type(e).__name__)\n"
            f"subprocess.Popen(['sleep', '120', '{marker}'], start_new_session=True)\n")
    result, _ = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "cgroup refused" in result.output_tail
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert marker.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pass


def test_a_full_package_installed_in_site_packages_is_hidden(tmp_path, monkeypatch):
    fake = tmp_path / "site" / "fastdl_lab"
    fake.mkdir(parents=True)
    (fake / "secret.py").write_text("ANSWER = 42\n")
    monkeypatch.setattr(bwrap, "_hidden_full_package", lambda: [str(fake)])
    result, _ = run(tmp_path, f"import os; print('listing', os.listdir({str(fake)!r}))",
                    read_only={str(tmp_path / 'site'): str(tmp_path / 'site')})
    assert "listing []" in result.output_tail, result.output_tail


def test_quick_mode_reaches_nbgrader_and_its_kernel_and_nothing_else_does(tmp_path, monkeypatch):
    assert kernel_jail.QUICK_VAR == device.QUICK_VAR
    course, profile = Course(tmp_path), {"gpu": False}
    monkeypatch.delenv(device.QUICK_VAR, raising=False)
    assert jobs.nbgrader_env(course.student_package, profile, isolated=True)[device.QUICK_VAR] == "1"
    monkeypatch.setenv(device.QUICK_VAR, "0")  # an instructor who wants the experiments full size
    assert jobs.nbgrader_env(course.student_package, profile, isolated=True)[device.QUICK_VAR] == "0"
    # The kernel launcher runs in nbgrader's environment and passes on only what the kernel needs.
    monkeypatch.setenv("FASTDL_GRADER_SECRET", "not for the kernel")
    kernel = kernel_jail._kernel_env(gpu=False)
    assert kernel[device.QUICK_VAR] == "0"
    assert "FASTDL_GRADER_SECRET" not in kernel
