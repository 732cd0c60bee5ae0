"""How a grading child hands its outputs to the parent: once, announced, and unchanged after.

The child's trusted code saves the outputs to ``outputs.pt`` in the work directory, creating the
file (a file, link or pipe already there is refused), then prints one marker line with the
SHA-256 of the bytes it wrote. The parent's reader stamps the marker as it arrives
(``sandbox.run_sandboxed``) and, once the child has ended, takes the outputs only when exactly one
marker came and the file holds exactly the announced bytes.

Student code in the child may still run after the trusted code has written: an exit hook, a
thread, a forked process that outlives its parent. Any of them could rewrite the file, and
without the announcement the parent would grade what they wrote. With it, a changed file or a
second marker is ``tampered``; a run that never reached the trusted write (the student's code
exited first) has no marker, and its file is not even opened.

This guards the way out, not the figures inside the process: code that runs as the student's
solution cells (``job["cells"]``) shares the interpreter with the trusted code and could change
what that code saves before it saves it. Kernel and screened-artefact items run no such code.
"""

from __future__ import annotations

import hashlib
import os

OUTPUTS = "outputs.pt"
# Every marker line of the grader starts with this (the record separator, then the grader's name:
# no print of ordinary text produces it); what follows names the marker's kind.
PREFIX = b"\x1efastdl-"
KIND = "outputs:"
DIGEST_CHARS = 64


class Refused(Exception):
    """The work directory already held something where the outputs go."""


def writer():
    """``write(workdir, data)``, made of functions bound now: call before any student code runs,
    so that rebinding ``os.write`` or ``hashlib.sha256`` later changes nothing here."""
    open_, write, close, join, sha256 = os.open, os.write, os.close, os.path.join, hashlib.sha256
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    prefix = PREFIX + KIND.encode()

    def write_outputs(workdir: str, data: bytes) -> None:
        try:
            fd = open_(join(workdir, OUTPUTS), flags, 0o600)
        except FileExistsError:
            raise Refused(f"{OUTPUTS} existed before the grader's code wrote it") from None
        try:
            view = memoryview(data)
            while view:
                view = view[write(fd, view):]
        finally:
            close(fd)
        # The newline first ends any line the student's code left unfinished.
        line = b"\n" + prefix + sha256(data).hexdigest().encode() + b"\n"
        while line:
            line = line[write(1, line):]

    return write_outputs


def digests(marks: list[tuple[str, float]]) -> list[str]:
    """The digests announced, from the parent's stamped markers (text after ``PREFIX``)."""
    return [text[len(KIND):len(KIND) + DIGEST_CHARS] for text, _ in marks if text.startswith(KIND)]


def problem(announced: list[str], data: bytes) -> str | None:
    """Why ``data`` (what the file holds now) is not what the child's trusted code delivered."""
    if len(announced) != 1:
        return f"the outputs were announced {len(announced)} times; the grader's code announces them once"
    if hashlib.sha256(data).hexdigest() != announced[0]:
        return f"{OUTPUTS} was changed after the grader's code wrote it"
    return None
