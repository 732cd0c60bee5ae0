"""The parent's side of a kernel speed item: the timed phase on its own clock, and whether the
child's samples could have come from it.

A kernel speed item runs no student Python in its child (only ``@triton.jit`` functions the
compiler accepted), so the child's trusted code times candidate and baseline
(``fastdl_lab.timing.compare``: device events, L2 flushed, A/B interleaved) and reports every
sample and batch size in its outputs. The parent still checks them against what it saw: the child
marks the start and the end of the timed phase on its channel (``channel.py``) and the parent's
reader stamps each mark with its own monotonic clock as it arrives. ``cross_check`` then compares
what the child says it timed with that wall time: samples inflated past the phase they were taken
in (a baseline made to look slow), or shrunk to nothing (a forged clock), are refused. Python the
student wrote is never timed this way: a ``Clocked`` item is timed call by call on the grader's
own clock (``grade._grade_clocked``).
Below about a second of timed calls the absolute tolerance dominates and only gross inflation is
caught: a speed item's ``min_run_s`` (profile parameter; whole rounds are added until each side has
run that long) makes the phase long enough for the relative tolerance to bite.
"""

from __future__ import annotations

import math

from fastdl_lab.timing import MAX_BATCH

PHASES = ("start", "end")
# The parent stamps a marker when its reader thread wakes for it: a few milliseconds late on a
# loaded host, and the start's lateness shortens the phase it sees. The timed samples may exceed
# the parent's phase by this much before they are called impossible.
REL_TOLERANCE = 0.05
ABS_TOLERANCE_S = 0.05
# The timed calls fill most of an honest phase (on a GPU they run back to back between L2
# flushes; on the host clock nothing else happens). Under a hundredth of it, the samples are not
# the calls' times.
FLOOR = 0.01
ROLES = ("candidate", "baseline")
# What a profile that names no warm-up or repetitions for a speed item gets.
DEFAULT_WARMUP = 3
DEFAULT_REPS = 15


def timing_marks(marks: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """``(phase, time)`` of the marks of the timed phase the channel stamped."""
    return [(phase, at) for phase, at in marks if phase in PHASES]


def phase_wall(marks: list[tuple[str, float]]) -> tuple[float | None, str]:
    """The parent's wall time of the timed phase from the markers it stamped ``(phase, time)``,
    or None and why the markers do not describe one phase."""
    phases = [phase for phase, _ in marks]
    if phases != list(PHASES):
        seen = ", ".join(phases) if phases else "none"
        return None, f"the timed phase was announced out of protocol (markers seen: {seen}; expected start, end)"
    return marks[1][1] - marks[0][1], ""


def cross_check(samples: dict[str, list[float]], batches: dict[str, int], wall_s: float, *, reps: int) -> str | None:
    """Why the child's timings cannot be what it measured in a phase of ``wall_s`` seconds (the
    parent's clock), or None when they are consistent.

    ``samples[role]`` are seconds per call, each the mean over ``batches[role]`` calls; ``reps``
    is how many samples of each role one round takes (the child adds whole rounds).
    """
    for role in ROLES:
        values, batch = samples.get(role), batches.get(role)
        if not values:
            return f"no {role} samples"
        if not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values):
            return f"a {role} sample is not a positive, finite number of seconds"
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_BATCH:
            return f"the {role} batch size {batch!r} is not a whole number of calls from 1 to {MAX_BATCH}"
    counts = {role: len(samples[role]) for role in ROLES}
    if len(set(counts.values())) != 1 or counts["candidate"] % reps:
        return (f"{counts['candidate']} candidate and {counts['baseline']} baseline samples: the two are timed in "
                f"interleaved rounds of {reps} each")
    timed = sum(sum(samples[role]) * batches[role] for role in ROLES)
    if not math.isfinite(wall_s) or wall_s <= 0:
        return f"the grader's clock measured no timed phase ({wall_s} s)"
    if timed > wall_s * (1 + REL_TOLERANCE) + ABS_TOLERANCE_S:
        return (f"the reported samples add up to {timed:.4g} s of timed calls, more than the {wall_s:.4g} s the "
                "grader's clock measured over the whole timed phase")
    if timed < FLOOR * wall_s:
        return (f"the reported samples add up to {timed:.4g} s, under {FLOOR:.0%} of the {wall_s:.4g} s the "
                "grader's clock measured over the timed phase")
    return None
