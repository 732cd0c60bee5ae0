"""The way a grading child's outputs reach the parent: written once by the trusted code, announced
with their digest, and refused when anything changed them afterwards (``engine/delivery.py``)."""

import hashlib
import os
import subprocess
import sys

import pytest

from autograder.engine import delivery, sandbox
from autograder.engine.delivery import PREFIX


def _announced(stdout: bytes) -> list[str]:
    marks = []
    sandbox._marker_lines(PREFIX, marks)(stdout)
    return delivery.digests(marks)


def _deliver_in_child(workdir, data: bytes, after: str = "") -> bytes:
    """A child that binds the writer, lets ``after`` (student code) run, then delivers ``data``
    and ends normally (exit hooks and threads run)."""
    probe = (f"import os, sys\nfrom autograder.engine import delivery\nwrite = delivery.writer()\n{after}\n"
             f"write(sys.argv[1], {data!r})\nprint('done')\n")
    done = subprocess.run([sys.executable, "-c", probe, str(workdir)], capture_output=True, timeout=60, check=True)
    return done.stdout


def test_what_was_written_is_what_is_announced(tmp_path):
    stdout = _deliver_in_child(tmp_path, b"weights")
    data = (tmp_path / delivery.OUTPUTS).read_bytes()
    assert data == b"weights"
    assert _announced(stdout) == [hashlib.sha256(b"weights").hexdigest()]
    assert delivery.problem(_announced(stdout), data) is None
    assert oct((tmp_path / delivery.OUTPUTS).stat().st_mode & 0o777) == "0o600"


def test_an_exit_hook_that_rewrites_the_outputs_is_caught(tmp_path):
    rewrite = ("import atexit\n"
               "atexit.register(lambda: open(os.path.join(sys.argv[1], 'outputs.pt'), 'wb').write(b'forged'))")
    stdout = _deliver_in_child(tmp_path, b"honest", after=rewrite)
    data = (tmp_path / delivery.OUTPUTS).read_bytes()
    assert data == b"forged"  # the hook ran after the trusted write
    assert "changed after the grader's code wrote it" in delivery.problem(_announced(stdout), data)


def test_a_second_announcement_is_caught(tmp_path):
    # The student's code announces the digest of what it will leave behind, and the grader's code
    # announces its own: two announcements, whichever comes first.
    forged = hashlib.sha256(b"forged").hexdigest()
    early = f"os.write(1, b'\\n' + delivery.PREFIX + b'outputs:{forged}\\n')"
    stdout = _deliver_in_child(tmp_path, b"honest", after=early)
    assert len(_announced(stdout)) == 2
    assert "announced 2 times" in delivery.problem(_announced(stdout), b"forged")


@pytest.mark.parametrize("planted", ["file", "link", "fifo"])
def test_something_already_where_the_outputs_go_is_refused(tmp_path, planted):
    target = tmp_path / delivery.OUTPUTS
    if planted == "file":
        target.write_bytes(b"forged")
    elif planted == "link":
        target.symlink_to(tmp_path / "elsewhere")
    else:
        os.mkfifo(target)
    write = delivery.writer()
    with pytest.raises(delivery.Refused, match="existed before the grader's code wrote it"):
        write(str(tmp_path), b"honest")
    assert not (tmp_path / "elsewhere").exists()


def test_no_announcement_means_nothing_was_delivered():
    assert "announced 0 times" in delivery.problem([], b"anything")
