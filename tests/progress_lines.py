"""Lines on the terminal while a long end-to-end step runs, past pytest's capture.

pytest keeps what tests and fixtures print and shows it only for a failure, so a fixture that
grades the demo class for minutes looks hung. ``Lines`` writes one line per unit of work to the
terminal of whoever runs pytest, with the time so far and what the whole step usually takes:

    demo class: [4/61] 03_layernorm reference: 17/17 in 9.1 s (1 m 41 s so far; usually ...)

Only a session that runs end-to-end tests (``make test-e2e``) gets them: ``make test`` grades the
same class beside hundreds of other tests, whose own progress already shows.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext


def clock(seconds: float) -> str:
    """``41 s`` or ``6 m 05 s``: what a person reads beside a wall clock."""
    seconds = round(seconds)
    return f"{seconds // 60} m {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


def runs_e2e(session) -> bool:
    return any(item.get_closest_marker("e2e") for item in session.items)


def write(config, line: str) -> None:
    """``line`` on the terminal now, whatever pytest captures.

    The capture manager is paused for the write (it holds file descriptors 1 and 2 while a fixture
    runs). In the main process pytest's terminal reporter writes it, starting a fresh line after a
    file's dots; an xdist worker has no terminal of its own but shares the controller's stderr."""
    plugins = config.pluginmanager
    capture = plugins.get_plugin("capturemanager")
    terminal = plugins.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        worker = getattr(config, "workerinput", None)
        if worker is None and terminal is not None:
            terminal.write_line(line)
            terminal.flush()
        else:
            prefix = f"[{worker['workerid']}] " if worker else ""
            print(prefix + line, file=sys.stderr, flush=True)


class Lines:
    """``lines(text)`` writes ``what: text (N so far; usually ...)``; silent unless ``on``."""

    def __init__(self, config, what: str, usual: str, *, on: bool = True):
        self.config, self.what, self.usual, self.on = config, what, usual, on
        self.started = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, text: str) -> None:
        if self.on:
            write(self.config, f"{self.what}: {text} ({clock(self.elapsed)} so far; usually {self.usual})")
