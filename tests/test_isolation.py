"""What a sandboxed child can see, write and reach: only its own work directory and what it is given."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import jobs
from autograder.course import Course
from autograder.engine import bwrap, kernel_jail, prefork
from autograder.engine.sandbox import Limits, run_sandboxed
from fastdl_lab import device

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
LIMITS = Limits(wall_s=30, cpu_s=30, memory_bytes=2 << 30, max_processes=8, output_bytes=64_000)


@pytest.fixture(scope="module", autouse=True)
def isolation_works():
    bwrap.check()  # the Makefile installs bubblewrap: a machine without it fails here, loudly


def _sandbox_folder(path):
    path.mkdir()
    bwrap.prepare_workdir(str(path))
    return path


@pytest.fixture(scope="module", params=["bubblewrap", "fork server"])
def server(request):
    """Every check below holds for a child bubblewrap starts and for one the fork server forks."""
    if request.param == "bubblewrap":
        yield None
        return
    if not prefork.enabled():
        pytest.skip("the fork server is used only where the grader runs as root")
    server = prefork.ForkServer(ENV)
    yield server
    server.close()


@pytest.fixture
def run(server):
    def run(tmp_path, code, *, read_only=None, scratch=None, limits=LIMITS):
        work = _sandbox_folder(tmp_path / "job")
        view = bwrap.View(str(work), read_only=read_only or {}, scratch=scratch or {})
        result = run_sandboxed([sys.executable, "-c", code], limits=limits, cwd=str(work), env=ENV, view=view,
                               server=server)
        return result, work

    return run


def test_runs_as_nobody_and_writes_only_its_work_dir(run, tmp_path):
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
def test_cannot_read_what_it_was_not_given(run, tmp_path, secret):
    result, _ = run(tmp_path, f"open({str(secret)!r}).read()")
    assert result.status == "error"
    assert "FileNotFoundError" in result.output_tail or "PermissionError" in result.output_tail


def test_temporary_files_go_to_its_own_capped_tmp(run, tmp_path):
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


def test_its_name_resolves_to_its_own_loopback_and_fonts_are_configured(run, tmp_path):
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


def test_a_scratch_folder_is_writable_where_it_is_shown(run, tmp_path):
    scratch = _sandbox_folder(tmp_path / "scratch")
    code = "open('/tmp/deep/er/folder/made', 'w').write('x'); open('/tmp/deep/beside', 'w').write('y')"
    result, work = run(tmp_path, code, scratch={str(scratch): "/tmp/deep/er/folder"})
    assert result.status == "ok", result.output_tail
    assert (scratch / "made").read_text() == "x"
    with pytest.raises(ValueError, match="/tmp"):
        bwrap.command(["true"], bwrap.View(str(work), scratch={str(scratch): "/job/elsewhere"}))


def test_a_file_bound_read_only_into_a_scratch_folder_cannot_change_even_for_its_owner(run, tmp_path):
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


def test_the_system_files_it_is_given_are_readable(run, tmp_path):
    # The folders bubblewrap makes for them would otherwise be root-only: torch asks the user
    # database who it is, and Triton asks the linker's cache where libcuda is.
    code = "import os, pwd; print(pwd.getpwuid(os.getuid()).pw_name); print(len(open('/etc/ld.so.cache', 'rb').read()) > 0)"
    result, _ = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "True" in result.output_tail


def test_given_folders_are_read_only(run, tmp_path):
    given = tmp_path / "pkg"
    given.mkdir()
    (given / "mod.py").write_text("X = 1\n")
    code = "print(open('/opt/pkg/mod.py').read()); open('/opt/pkg/mod.py', 'w').write('X = 2')"
    result, _ = run(tmp_path, code, read_only={str(given): "/opt/pkg"})
    assert "X = 1" in result.output_tail
    assert result.status == "error" and ("Read-only" in result.output_tail or "Permission" in result.output_tail)
    assert (given / "mod.py").read_text() == "X = 1\n"


def test_sees_no_other_process(run, tmp_path):
    code = "import os; print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))"
    result, _ = run(tmp_path, code)
    pids = eval(result.output_tail.split("pids", 1)[1])
    assert max(pids) < 10, pids  # its own pid namespace: bubblewrap's init and itself


def test_no_network_but_loopback(run, tmp_path):
    code = ("import socket\n"
            "s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname(), timeout=2)\n"
            "print('loopback ok')\n"
            "socket.create_connection(('1.1.1.1', 53), timeout=2)\n")
    result, _ = run(tmp_path, code)
    assert "loopback ok" in result.output_tail
    assert result.status == "error" and "unreachable" in result.output_tail.lower()


def test_cannot_leave_its_cgroup_or_outlive_the_run(run, tmp_path):
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


def test_a_full_package_installed_in_site_packages_is_hidden(run, tmp_path, monkeypatch):
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
    kernel = kernel_jail.kernel_env(gpu=False)
    assert kernel[device.QUICK_VAR] == "0"
    assert "FASTDL_GRADER_SECRET" not in kernel


def test_holds_no_capability_privilege_or_descriptor_of_the_grader(run, tmp_path):
    code = ("import os\n"
            "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "print('caps', [status[k] for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')])\n"
            "print('nnp', status['NoNewPrivs'], 'groups', os.getgroups())\n"
            "fds = os.listdir('/proc/self/fd'); print('fds', sorted(int(f) for f in fds)[:4])")
    result, _ = run(tmp_path, code)
    assert result.status == "ok", result.output_tail
    assert "caps " + str(["0000000000000000"] * 5) in result.output_tail
    assert "nnp 1 groups []" in result.output_tail
    assert "fds [0, 1, 2, 3]" in result.output_tail  # 3: the listing's own descriptor


@pytest.mark.parametrize("code, status, rc", [
    ("import sys; sys.exit(3)", "error", 3),
    ("raise KeyError('boom')", "error", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed", -11),
])
def test_ends_as_a_fresh_interpreter_would(run, tmp_path, code, status, rc):
    result, _ = run(tmp_path, code)
    assert (result.status, result.returncode) == (status, rc), result.output_tail
    if rc == 1:
        assert "KeyError: 'boom'" in result.output_tail


def test_a_loop_that_never_ends_is_stopped_with_all_it_started(run, tmp_path):
    marker = f"fastdl-loop-{os.getpid()}"
    code = f"import subprocess, time\nsubprocess.Popen(['sleep', '120', '{marker}'])\nwhile True: time.sleep(0.1)"
    result, _ = run(tmp_path, code, limits=Limits(wall_s=3, cpu_s=30, memory_bytes=2 << 30, max_processes=8))
    assert result.status == "timeout", result.output_tail
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert marker.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pass


def test_memory_is_counted_once_and_still_limited(run, tmp_path):
    # A forked child shares the warm interpreter's pages with its monitor and init (about 225 MiB
    # each on the 2-core machine, against 220-230 MiB for a child that has imported torch):
    # counting them three times would fail items that fit.
    limits = Limits(wall_s=60, cpu_s=60, memory_bytes=640 << 20, max_processes=8)
    result, _ = run(tmp_path, "import torch, time; torch.ones(8); time.sleep(0.5); print('fine')", limits=limits)
    assert result.status == "ok" and "fine" in result.output_tail, result.output_tail
    (tmp_path / "hog").mkdir()
    hog = "import time; b = bytearray(1 << 30); time.sleep(5)"
    result, _ = run(tmp_path / "hog", hog, limits=Limits(wall_s=60, cpu_s=60, memory_bytes=640 << 20, max_processes=8,
                                                 limit_address_space=False))
    assert result.status == "memory", result.output_tail


def test_the_processes_a_child_starts_are_counted_from_outside_and_the_sandboxes_own_are_not(run, tmp_path):
    # Three processes beside the program for half a second: at least ten of the watchdog's samples.
    started = ("import subprocess, time\n"
               "procs = [subprocess.Popen(['sleep', '0.5']) for _ in range(3)]\n"
               "[p.wait() for p in procs]\n")
    (tmp_path / "three").mkdir()
    result, _ = run(tmp_path / "three", started)
    assert result.status == "ok" and result.processes == 4, (result.processes, result.output_tail)
    (tmp_path / "alone").mkdir()
    result, _ = run(tmp_path / "alone", "import time; time.sleep(0.3)")
    assert result.status == "ok" and result.processes == 1, result.processes


@pytest.mark.parametrize("server", ["fork server"], indirect=True)
def test_a_forked_child_finds_torch_warm_and_nothing_of_the_course(server, tmp_path):
    work = _sandbox_folder(tmp_path / "job")
    code = "import sys; print('warm', 'torch' in sys.modules, sorted(m for m in sys.modules if m.startswith(('fastdl', 'autograder'))))"
    result = run_sandboxed([sys.executable, "-c", code], limits=LIMITS, cwd=str(work), env=ENV,
                           view=bwrap.View(str(work)), server=server)
    assert result.forked and result.status == "ok", result.output_tail
    assert "warm True []" in result.output_tail


def test_a_dead_fork_server_leaves_children_to_bubblewrap(tmp_path):
    if not prefork.enabled():
        pytest.skip("the fork server is used only where the grader runs as root")
    server = prefork.ForkServer(ENV)
    server.close()
    work = _sandbox_folder(tmp_path / "job")
    result = run_sandboxed([sys.executable, "-c", "print('cold')"], limits=LIMITS, cwd=str(work), env=ENV,
                           view=bwrap.View(str(work)), server=server)
    assert result.status == "ok" and result.sandboxed and not result.forked, result.output_tail


HUNT = ("import gc, sys, types\n"
        "name = 'compute_bound_batch_ref'\n"
        "held = [m.__name__ for m in list(sys.modules.values()) if isinstance(getattr(m, name, None), types.FunctionType)]\n"
        "held += [o.__module__ for o in gc.get_objects() if isinstance(o, types.FunctionType) and o.__name__ == name]\n"
        "print('held', held)")


@pytest.mark.parametrize("preload, found", [(prefork.PRELOAD, False), (("fastdl_lab.measure",), True)],
                         ids=["the grader's server", "a server that imported the package"])
def test_the_warm_interpreter_holds_no_reference_a_child_could_copy(tmp_path, preload, found):
    # What tests/adversarial/00_measure-hunts-the-warm-interpreter.py searches for. The second case
    # shows the search finds a reference where one is held: a server that had imported the full
    # package (importable here, from this checkout) would hand it to every child.
    if not prefork.enabled():
        pytest.skip("the fork server is used only where the grader runs as root")
    server = prefork.ForkServer(ENV, preload)
    try:
        work = _sandbox_folder(tmp_path / "job")
        result = run_sandboxed([sys.executable, "-c", HUNT], limits=LIMITS, cwd=str(work), env=ENV,
                               view=bwrap.View(str(work)), server=server)
    finally:
        server.close()
    assert result.forked and result.status == "ok", result.output_tail
    assert ("held []" not in result.output_tail) == found, result.output_tail


@pytest.mark.parametrize("preload", [prefork.PRELOAD, prefork.KERNEL_PRELOAD], ids=["items", "kernels"])
def test_the_warm_imports_write_nothing_where_the_environment_points(tmp_path, preload):
    # A server imports with its children's environment but outside their sandbox, on the
    # grader's filesystem: an import that makes a folder the environment names (matplotlib's
    # config folder) would make it there. Here every such folder is moved under tmp_path.
    job = tmp_path / "job"
    env = {var: value.replace(bwrap.JOB, str(job)) for var, value in kernel_jail.kernel_env(False).items()}
    done = subprocess.run([sys.executable, "-P", "-c", f"import importlib; [importlib.import_module(m) for m in {list(preload)!r}]"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not job.exists(), sorted(str(p.relative_to(job)) for p in job.rglob("*"))


SETTLED_AT_IMPORT = ("import getpass, json, tempfile\n"
                     "from torch._inductor import codecache\n"
                     "print(json.dumps([codecache._HEADER_DIR, getpass.getuser(), tempfile.gettempdir()]))")


def test_a_forked_kernel_settles_at_import_what_a_cold_one_settles(tmp_path):
    # What a library fixes when it is imported is fixed in the server, as the grader, outside the
    # sandbox: inductor's folder of precompiled headers is named after the user. A forked kernel
    # that looked for its headers under the grader's name rebuilt them (6 s) in every notebook.
    if not prefork.enabled():
        pytest.skip("the fork server is used only where the grader runs as root")
    env = kernel_jail.kernel_env(False)
    server = prefork.ForkServer(env, prefork.KERNEL_PRELOAD)
    seen = []
    try:
        for started in (server, None):
            work = _sandbox_folder(tmp_path / f"job{len(seen)}")
            result = run_sandboxed([sys.executable, "-c", SETTLED_AT_IMPORT], limits=LIMITS, cwd=str(work), env=env,
                                   view=bwrap.View(str(work)), server=started)
            assert result.status == "ok" and result.forked == (started is not None), result.output_tail
            seen.append(json.loads(result.output_tail.strip().splitlines()[-1]))
    finally:
        server.close()
    assert seen[0] == seen[1] and seen[0][1] == bwrap.NOBODY_NAME, seen


UNPRIVILEGED_GRADER = r'''
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from autograder.engine import bwrap, prefork
from autograder.engine.sandbox import Limits, run_sandboxed
env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
code = """
import os, socket
status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)
refused = []
for path in ('/out', '/usr/x'):
    try:
        open(path, 'w')
    except OSError:
        refused.append(path)
s = socket.create_server(('127.0.0.1', 0)); socket.create_connection(s.getsockname(), timeout=2)
open('/job/out', 'w').write('x')
print('SEEN', repr([os.getuid(), os.getgid(), status['CapEff'], status['CapBnd'], status['NoNewPrivs'],
                    sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), refused]))
"""
found = {}
for kind, server in (("fork server", prefork.ForkServer(env)), ("bubblewrap", None)):
    work = tempfile.mkdtemp()
    bwrap.prepare_workdir(work)
    result = run_sandboxed([bwrap.PYTHON, "-c", code], limits=Limits(wall_s=60), cwd=work, env=env,
                           view=bwrap.View(work), server=server)
    seen = result.output_tail.split("SEEN ", 1)[-1].strip()
    found[kind] = [result.status, result.forked, seen, os.stat(os.path.join(work, "out")).st_uid]
print(json.dumps({"grader": os.geteuid(), "found": found}))
'''


def _shown_to_everyone(*paths: str) -> list[str]:
    """Shell steps that, in a private mount namespace, let any uid reach ``paths``: each folder on
    the way that others cannot enter (this machine's interpreter lives under root's 0700 home,
    pytest's folders under a 0700 one) is covered by a tmpfs holding only the folders below it
    on the way."""
    below: dict[Path, set[str]] = {}
    for path in paths:
        for parent in Path(path).parents:
            if parent != Path("/") and not os.stat(parent).st_mode & 0o001:
                below.setdefault(parent, set()).add(Path(path).relative_to(parent).parts[0])
    steps = []
    for parent, children in sorted(below.items(), key=lambda kv: len(kv[0].parts)):  # outer folders first
        binds = " && ".join(f"mkdir $d/{c} && mount --rbind {parent}/{c} $d/{c}" for c in sorted(children))
        steps.append(f"d=$(mktemp -d) && mount -t tmpfs -o mode=0755 tmpfs $d && {binds} && mount --rbind $d {parent}")
    return steps


def test_an_unprivileged_grader_gets_the_same_sandbox_from_both(tmp_path):
    # A grader that is not root: both kinds of child make a user namespace that maps its uid to
    # the sandbox's. Run here as uid 65534 with no capability.
    if os.geteuid() != 0:
        pytest.skip("this run is already unprivileged: every test above covers it")
    home = tmp_path / "grader"
    home.mkdir()
    os.chown(home, bwrap.NOBODY, bwrap.NOBODY)
    script = home / "grader.py"
    script.write_text(UNPRIVILEGED_GRADER)
    steps = _shown_to_everyone(os.path.realpath(sys.executable), str(home), str(ROOT)) + [
        f"exec {bwrap.SETPRIV} --reuid={bwrap.NOBODY} --regid={bwrap.NOBODY} --clear-groups --inh-caps=-all "
        f"--bounding-set=-all env HOME={home} TMPDIR={home} {sys.executable} {script} {ROOT}"]
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(steps)],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["grader"] == bwrap.NOBODY
    expected = [bwrap.NOBODY, bwrap.NOBODY, "0000000000000000", "0000000000000000", "1", [1, 2], ["/out", "/usr/x"]]
    for kind, forked in (("fork server", True), ("bubblewrap", False)):
        status, was_forked, seen, owner = report["found"][kind]
        assert (status, was_forked) == ("ok", forked), (kind, seen)
        assert eval(seen) == expected, (kind, seen)
        assert owner == bwrap.NOBODY  # the grader's own uid, outside
