"""A trusted run (nbgrader's run of a notebook) forked from a warm server gets what the same program
started cold by ``run_sandboxed`` without a view gets: the grader's uid and filesystem, its own
session, jail and network namespace with loopback, the limits, and the same exit statuses."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from autograder import jobs
from autograder.engine import prefork
from autograder.engine.sandbox import Limits, run_sandboxed

ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "FASTDL_PROBE": "given"}
# As nbgrader's own limits: no address-space limit (its kernel's torch reserves much), loopback up.
LIMITS = Limits(wall_s=30, cpu_s=30, memory_bytes=1 << 30, limit_address_space=False, max_processes=8,
                output_bytes=64_000, loopback=True)

REPORT = r"""
import json, os, socket
with socket.create_server(("127.0.0.1", 0)) as listener:
    with socket.create_connection(listener.getsockname()):
        loopback = True
print(json.dumps({"uid": os.getuid(), "cwd": os.getcwd(), "env": os.environ.get("FASTDL_PROBE"),
                  "interfaces": sorted(line.split(":")[0].strip() for line in open("/proc/self/net/dev").readlines()[2:]), "loopback": loopback,
                  "cgroup": open("/proc/self/cgroup").read(), "session": os.getsid(0) != os.getpid(),
                  "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
"""


@pytest.fixture(scope="module", params=["cold", "fork server"])
def server(request):
    if request.param == "cold":
        yield None
        return
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: every trusted run starts cold")
    server = prefork.ForkServer(ENV, preload=("json",), trusted=True)
    yield server
    server.close()


def _run(server, tmp_path, code, limits=LIMITS):
    return run_sandboxed([sys.executable, "-c", code], limits=limits, cwd=str(tmp_path), env=ENV, server=server)


def test_runs_as_the_grader_in_its_own_network_and_jail(server, tmp_path):
    result = _run(server, tmp_path, REPORT)
    assert result.status == "ok", result.output_tail
    assert result.forked == (server is not None)
    seen = json.loads(result.output_tail.strip().splitlines()[-1])
    assert seen["uid"] == os.getuid() and seen["cwd"] == str(tmp_path) and seen["env"] == "given"
    assert result.network_isolated and seen["interfaces"] == ["lo"] and seen["loopback"]
    if result.jailed:
        assert "fastdl-" in seen["cgroup"]
    assert seen["fds"] == [0, 1, 2, 3]  # 3: the listing's own descriptor
    assert not result.sandboxed


@pytest.mark.parametrize("code, status, rc", [
    ("pass", "ok", 0),
    ("import sys; sys.exit(3)", "error", 3),
    ("raise ValueError('no')", "error", 1),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "crashed", -signal.SIGSEGV),
])
def test_ends_as_the_program_started_cold_would(server, tmp_path, code, status, rc):
    result = _run(server, tmp_path, code)
    assert (result.status, result.returncode) == (status, rc), result.output_tail


def test_its_memory_counts_against_the_limit(server, tmp_path):
    # The monitor of a forked run is a copy of the warm server and is left out of the count; the
    # program below it is not a sandbox's init and is counted.
    code = "import time\nblock = bytearray(1536 << 20)\nblock[::4096] = b'x' * len(block[::4096])\ntime.sleep(30)"
    result = _run(server, tmp_path, code)
    assert result.status == "memory", (result.status, result.reason)


def test_a_run_that_never_ends_is_stopped_with_what_it_started(server, tmp_path):
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open('late.pid', 'w').write(str(p.pid))\n"
            "while True:\n    time.sleep(0.1)\n")
    result = _run(server, tmp_path, code, limits=Limits(**{**LIMITS.__dict__, "wall_s": 3}))
    assert result.status == "timeout", result.reason
    late = int((tmp_path / "late.pid").read_text())
    assert not os.path.exists(f"/proc/{late}") or open(f"/proc/{late}/stat").read().split()[2] == "Z"


def test_nbgraders_warm_imports_write_nothing_and_run_nbgrader(tmp_path):
    # The server imports with nbgrader's environment, before any run: nothing may be made where the
    # environment points (the grader's caches), and the command line must still be nbgrader's.
    env = {**os.environ, "HOME": str(tmp_path / "home"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    imports = f"import importlib; [importlib.import_module(m) for m in {list(prefork.NBGRADER_PRELOAD)!r}]"
    done = subprocess.run([sys.executable, "-P", "-c", imports], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert not any(tmp_path.iterdir()), sorted(str(p) for p in tmp_path.rglob("*"))
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: nbgrader starts cold")
    server = jobs.nbgrader_server({var: env[var] for var in ("PATH", "HOME") if var in env})
    assert server is not None
    work = tmp_path / "run"
    work.mkdir()
    result = run_sandboxed([sys.executable, "-m", "autograder.nbgrader_main", "--version"], limits=LIMITS,
                           cwd=str(work), env={"PATH": env["PATH"], "HOME": env["HOME"]}, server=server)
    assert result.forked and result.status == "ok", result.output_tail
    assert result.output_tail.strip().splitlines()[-1].startswith("nbgrader version"), result.output_tail
    assert "Warning" not in result.output_tail, result.output_tail


def test_the_kernel_relay_never_starts_a_trusted_run(tmp_path):
    # The relay forwards a launcher's request to the kernels' server: a request without a sandbox
    # plan must be dropped, whoever sent it (the relay drops it, and the server would too).
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: no relay")
    from autograder.engine import kernel_jail

    proof = tmp_path / "ran"
    env = kernel_jail.kernel_env(False)
    request = prefork._trusted_spec([sys.executable, "-c", f"open({str(proof)!r}, 'w')"], str(tmp_path), env, {},
                                    None, isolate_network=False, loopback=False, marker=str(tmp_path / ".network"))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    netns = os.open("/proc/self/ns/net", os.O_RDONLY)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
        connection.connect(prefork.kernel_relay())
        socket.send_fds(connection, [json.dumps(request).encode()], [theirs.fileno(), 2, netns])
    theirs.close()
    os.close(netns)
    ours.settimeout(prefork.START_S)
    assert ours.recv(prefork.REPLY_BYTES) == b""  # closed without a pid: nothing was forked
    ours.close()
    assert not proof.exists()


def test_a_server_serves_one_kind_of_request(tmp_path):
    # nbgrader's server has imported the grader's own modules: a sandbox forked from it would find
    # them in its memory. And a sandboxes' server never runs anything as the grader.
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: no servers")
    from autograder.engine import bwrap

    for trusted in (True, False):
        server = prefork.ForkServer(ENV, preload=("json",), trusted=trusted)
        try:
            with pytest.raises(ValueError):
                if trusted:
                    server.spawn([sys.executable, "-c", "pass"], view=bwrap.View(str(tmp_path)), env=ENV, rlimits={},
                                 jail=None)
                else:
                    server.run_trusted([sys.executable, "-c", "pass"], cwd=str(tmp_path), env=ENV, rlimits={}, jail=None,
                                       isolate_network=True, loopback=False, marker=str(tmp_path / ".network"))
        finally:
            server.close()


def test_a_server_drops_a_request_of_the_other_kind_handed_to_it_directly(tmp_path):
    # What spawn and run_trusted refuse in the grader, the server itself refuses too: a request
    # forwarded raw (as the kernel relay forwards a launcher's) runs nothing.
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: no servers")
    from autograder.engine import bwrap

    proof = tmp_path / "ran"
    argv = [sys.executable, "-c", f"open({str(proof)!r}, 'w')"]
    requests = {True: prefork._spec(argv, bwrap.View(str(tmp_path)), ENV, {}, None, "item"),
                False: prefork._trusted_spec(argv, str(tmp_path), ENV, {}, None, isolate_network=False,
                                             loopback=False, marker=str(tmp_path / ".network"))}
    for trusted, request in requests.items():
        server = prefork.ForkServer(ENV, preload=("json",), trusted=trusted)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        read_end, write_end = os.pipe()
        try:
            server.forward(json.dumps(request).encode(), [theirs.fileno(), write_end])
            theirs.close()
            os.close(write_end)
            ours.settimeout(prefork.START_S)
            assert ours.recv(prefork.REPLY_BYTES) == b"", trusted  # closed without a pid
        finally:
            ours.close()
            os.close(read_end)
            server.close()
    assert not proof.exists()


def test_the_kernel_relay_folder_goes_with_the_grading_process(tmp_path):
    """Every grading process opens the relay's folder in the temporary directory; it must not stay
    behind once that process has ended."""
    if not prefork.enabled():
        pytest.skip("FASTDL_PREFORK=0: no relay")
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    program = "from autograder.engine import prefork; print(prefork.kernel_relay())"
    path = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert path.startswith(str(tmp_path)) and path.endswith("kernels.sock")
    assert not os.path.exists(os.path.dirname(path)) and list(tmp_path.iterdir()) == []
