"""The private folder a grading job works in, and the sweep that removes those of dead jobs.

A job's folder holds the student's cells, the item children's work folders and nbgrader's copy of
the course. A worker killed mid-job (SIGKILL, the out-of-memory killer, a node's restart) cannot
remove it. So each job holds an exclusive lock on its folder while its process lives. The kernel
drops the lock when that process dies, however it dies, so a folder whose lock can be taken
belongs to no live job and goes. No process ids are compared: they are reused, and differ
between containers that share a /tmp.
"""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PREFIX = "fastdl-job-"
# A folder is made under this name, locked, then renamed: a sweep never sees one unlocked.
_UNCLAIMED = "fastdl-claim-"


@contextmanager
def job_folder() -> Iterator[Path]:
    """A new folder in the temporary directory, locked for as long as the block runs; removed after."""
    made = tempfile.mkdtemp(prefix=_UNCLAIMED)
    fd = os.open(made, os.O_RDONLY | os.O_DIRECTORY)
    held = made
    try:
        # flock, not lockf: flock's lock belongs to this open file, so a sweep run by another job
        # of the same process cannot take it; lockf's would be this whole process's.
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = Path(os.path.dirname(made), PREFIX + os.path.basename(made)[len(_UNCLAIMED):])
        os.rename(made, path)
        held = path
        yield path
    finally:
        shutil.rmtree(held, ignore_errors=True)
        os.close(fd)


def remove_abandoned(within: str | None = None) -> list[str]:
    """Remove the job folders in ``within`` (the temporary directory) that no live job holds;
    their paths. A folder this user may not open is another user's and is left alone."""
    removed = []
    for path in glob.glob(os.path.join(within or tempfile.gettempdir(), PREFIX + "*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: its job is running
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
