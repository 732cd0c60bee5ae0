"""A submission attacks what runs beside it while one job grades it: nbgrader's run of the notebook
shares the job's item slots (``jobs.grade_job``), so the student's code in nbgrader's kernel and in
an item's child run at the same time.

The hostile cell is the reference's ``timing_code`` with an attack after it. Wherever it runs it
lists every process it can see, looks for the engine's work folders, and sends SIGKILL to every
process id there is but its own threads' and its parent's. In the item's child it then holds on
until this test releases it (a SIGCONT, whose default action is nothing) once nbgrader's kernel has
ended, so that the kernel reaches the cell while that child is alive however loaded the machine is.
The other item, the held one and nbgrader's run must all end as they would for the reference, and
nbgrader's kernel must not have seen any process or folder of the engine's.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from autograder import jobs
from autograder.course import copy_build
from autograder.engine import forkserver, prefork
from autograder.engine.sandbox import descendants
from autograder.submissions import make_submission, reference_solutions

pytestmark = pytest.mark.slow
LAB = "00_measure"
REPORT = "BESIDE-ATTACK "
# The longest the item's child waits for this test's release: well inside the item's wall limit.
HOLD_S = 60
# Where the engine makes its work folders (fastdl-<item>-*, fastdl-job-*), as this host names it.
ENGINE_FOLDERS = os.path.join(tempfile.gettempdir(), "fastdl-*")
# The process names of a forked item sandbox's monitor and of a forked kernel's, and of the process
# a forked sandbox runs its code in.
ITEM_MONITOR = forkserver.MONITOR_NAME.format(label="item")
KERNEL_MONITOR = forkserver.MONITOR_NAME.format(label="kernel")
FORKED_CHILD = forkserver.NAMES["child"]
ATTACK = f'''

import glob as _glob
import json as _json
import os as _os
import signal as _signal
import time as _time

def _attack():
    seen = {{}}
    for pid in filter(str.isdigit, _os.listdir("/proc")):
        try:
            with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                seen[pid] = f.read().replace(b"\\0", b" ").decode(errors="replace")[:200]
        except OSError:
            pass
    # A thread's id is a process id to kill(): the kernel's own threads would take it down.
    spared, killed = {{_os.getppid(), *map(int, _os.listdir("/proc/self/task"))}}, 0
    for pid in range(2, 1 << 16):
        if pid not in spared:
            try:
                _os.kill(pid, _signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return seen, _glob.glob({ENGINE_FOLDERS!r}), killed

_began = _time.time()
_seen, _folders, _killed = _attack()
# Again a moment later: whatever started in between.
_time.sleep(1)
_more, _more_folders, _more_killed = _attack()
print({REPORT!r} + _json.dumps({{"began": _began, "ended": _time.time(), "processes": {{**_seen, **_more}},
                                 "folders": _folders + _more_folders, "killed": _killed + _more_killed}}))
if _os.path.exists("/job/in/job.json"):  # the engine's child of this item: held until released
    _released = []
    _signal.signal(_signal.SIGCONT, lambda *_: _released.append(1))
    _until = _time.monotonic() + {HOLD_S}
    while not _released and _time.monotonic() < _until:
        _time.sleep(0.05)
'''


def _command(pid: int) -> tuple[str, bytes]:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip(), Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "", b""


def _watch_children(alive: list[float], folders: set[str], stop: threading.Event) -> None:
    """Stamps the moments at which an engine child started by this test exists, collects the
    engine's work folders seen from here meanwhile, and releases the held item child once
    nbgrader's kernel, seen running, has gone."""
    kernel_seen = kernel_gone = False
    while not stop.is_set():
        folders.update(glob.glob(ENGINE_FOLDERS))
        item_children, kernel_now = [], False
        for pid in descendants(os.getpid()):
            comm, cmdline = _command(pid)
            # A kernel forked by the kernels' server, or started by bubblewrap.
            kernel_now |= comm == KERNEL_MONITOR or b"ipykernel_launcher" in cmdline
            # Started by bubblewrap, or forked by the fork server (which names its processes).
            if b"autograder.engine.child" in cmdline or comm == ITEM_MONITOR:
                item_children.append(pid)
        if item_children:
            alive.append(time.time())
        kernel_seen |= kernel_now
        kernel_gone |= kernel_seen and not kernel_now
        if kernel_gone:
            # SIGCONT does nothing to a process that does not handle it: only the held cell does.
            for pid in descendants(os.getpid()):
                comm, cmdline = _command(pid)
                if b"autograder.engine.child" in cmdline or comm == FORKED_CHILD:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except OSError:
                        pass
        stop.wait(0.1)


def _reports(executed: str) -> list[dict]:
    found = []
    for cell in json.loads(executed)["cells"]:
        for output in cell.get("outputs", ()):
            text = output.get("text", "")
            text = "".join(text) if isinstance(text, list) else text
            found += [json.loads(m) for m in re.findall(re.escape(REPORT) + r"(\{.*\})", text)]
    return found


def test_code_in_nbgrader_kernel_and_item_children_cannot_reach_each_other(course, cpu, tmp_path):
    copy = copy_build(course, tmp_path / "course")
    cells = reference_solutions(copy, LAB)
    cells["timing_code"] += ATTACK
    make_submission(copy, LAB, "attacker", cells)
    scratch = jobs.prepare_scratch(copy, LAB, tmp_path / "scratch")
    spec = jobs.JobSpec(str(copy.root), str(scratch), LAB, "attacker", cpu, seed=5, item_parallel=2)

    alive: list[float] = []
    folders: set[str] = set()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_children, args=(alive, folders, stop), daemon=True)
    watcher.start()
    try:
        result = jobs.grade_job(spec)
    finally:
        stop.set()
        watcher.join()

    assert not result["error"]
    # The kernel survived its own attack and ran the rest of the notebook (a dead one is an error).
    assert result["nbgrader"]["returncode"] == 0, result["nbgrader"]
    # Both items, the held one included, graded as the reference's would be.
    assert {i["item"]: i["status"] for i in result["items"]} == {"roofline": "passed", "timing": "passed"}
    [report] = _reports(result["autograded"])
    # nbgrader's kernel ran the attack while an engine child was alive...
    assert any(report["began"] <= t <= report["ended"] for t in alive), (report["began"], report["ended"], alive[-3:])
    # ...and saw none of it, nor nbgrader itself: only its own sandbox, its own pid namespace
    # (a forked kernel and a forked item child run the same command line).
    commands = " | ".join(report["processes"].values())
    assert "autograder.engine.child" not in commands and "nbgrader" not in commands, commands
    assert max(map(int, report["processes"])) < 64, report["processes"]
    if prefork.enabled():  # the kernel was forked warm by this process's server, its pid 1 the init
        assert "forkserver.py" in report["processes"].get("1", ""), report["processes"]
    # The folders it looked for were there, outside its sandbox.
    assert folders and report["folders"] == []
