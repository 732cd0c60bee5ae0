"""The way a grading child's outputs reach the parent: written once by the trusted code, announced
with their digest, and refused when anything changed them afterwards (``engine/delivery.py``)."""

import hashlib
import io
import os
import subprocess
import sys

import pytest
import torch

from autograder.engine import delivery, grade, sandbox
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


def _saved(workdir, value) -> tuple[bytes, str]:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    data = buffer.getvalue()
    (workdir / delivery.OUTPUTS).write_bytes(data)
    return data, hashlib.sha256(data).hexdigest()


def test_the_parent_grades_only_what_was_announced(tmp_path):
    data, digest = _saved(tmp_path, {"y": torch.arange(3)})
    assert torch.equal(grade.delivered_outputs(str(tmp_path), [digest])["y"], torch.arange(3))
    verdicts = {}
    for case, announced in [("none", []), ("twice", [digest, digest]), ("other", ["0" * 64])]:
        with pytest.raises(grade.Undelivered) as info:
            grade.delivered_outputs(str(tmp_path), announced)
        verdicts[case] = info.value.status
    (tmp_path / delivery.OUTPUTS).unlink()
    (tmp_path / delivery.OUTPUTS).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(grade.Undelivered) as info:
        grade.delivered_outputs(str(tmp_path), [digest])
    verdicts["link"] = info.value.status
    assert verdicts == {"none": "failed", "twice": "tampered", "other": "tampered", "link": "tampered"}


def test_outputs_too_large_to_read_are_failed_not_tampered(tmp_path, monkeypatch):
    data, digest = _saved(tmp_path, torch.zeros(1000))
    monkeypatch.setattr(grade, "OUTPUTS_CAP", len(data) - 1)
    with pytest.raises(grade.Undelivered) as info:
        grade.delivered_outputs(str(tmp_path), [digest])
    assert (info.value.status, info.value.reason) == ("failed", f"the outputs are larger than {0} MiB")
