"""The speed path of the engine, without a GPU: the parent's cross-check of the child's samples
against its own clock, the phase marks on the child's channel, the instruments bound before student
code, and speed items graded alone."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from autograder.engine import channel, child, grade, sandbox, speed
from autograder.engine.items import Item
from fastdl_lab import timing

ROUND = 3


def samples(candidate=(1e-3,) * ROUND, baseline=(2e-3,) * ROUND):
    return {"candidate": list(candidate), "baseline": list(baseline)}


BATCHES = {"candidate": 1, "baseline": 1}


def test_samples_that_fit_the_parents_clock_are_accepted():
    assert speed.cross_check(samples(), BATCHES, wall_s=0.012, reps=ROUND) is None
    # Host samples are means over a batch of calls: the batch multiplies them back.
    assert speed.cross_check(samples((1e-6,) * ROUND, (2e-6,) * ROUND), {"candidate": 500, "baseline": 500},
                             wall_s=0.012, reps=ROUND) is None


def test_samples_adding_up_to_more_than_the_phase_are_refused():
    inflated = samples(baseline=(0.2,) * ROUND)  # a baseline made to look slow
    reason = speed.cross_check(inflated, BATCHES, wall_s=0.1, reps=ROUND)
    assert reason and "more than the 0.1 s" in reason
    # Within the stated tolerance of the parent's stamping, the same sum is believed.
    wall = 0.603 / (1 + speed.REL_TOLERANCE)
    assert speed.cross_check(inflated, BATCHES, wall_s=wall, reps=ROUND) is None


def test_samples_far_below_the_phase_are_refused():
    reason = speed.cross_check(samples((1e-9,) * ROUND, (1e-9,) * ROUND), BATCHES, wall_s=2.0, reps=ROUND)
    assert reason and "under 1%" in reason


@pytest.mark.parametrize("bad, words", [
    (samples(candidate=()), "no candidate samples"),
    (samples(candidate=(1e-3, -1e-3, 1e-3)), "positive, finite"),
    (samples(baseline=(float("nan"),) * ROUND), "positive, finite"),
    (samples(baseline=(2e-3,) * (ROUND + 1)), "interleaved rounds"),
    (samples((1e-3,) * (ROUND - 1), (1e-3,) * (ROUND - 1)), "interleaved rounds"),
])
def test_samples_of_the_wrong_shape_are_refused(bad, words):
    assert words in speed.cross_check(bad, BATCHES, wall_s=1.0, reps=ROUND)


@pytest.mark.parametrize("batch", [0, 10**9, 2.5, True, "3"])
def test_impossible_batch_sizes_are_refused(batch):
    assert "batch size" in speed.cross_check(samples(), {"candidate": batch, "baseline": 1}, wall_s=1.0, reps=ROUND)


def test_the_phase_wall_needs_exactly_one_start_then_one_end():
    assert speed.phase_wall([("start", 10.0), ("end", 10.5)]) == (0.5, "")
    for marks in ([], [("start", 1.0)], [("end", 1.0), ("start", 2.0)],
                  [("start", 1.0), ("end", 2.0), ("end", 3.0)], [("start", 1.0), ("start", 1.5), ("end", 2.0)]):
        wall, why = speed.phase_wall(marks)
        assert wall is None and "out of protocol" in why
    assert speed.timing_marks([("start", 1.0), ("middle", 1.5), ("end", 2.0)]) == [("start", 1.0), ("end", 2.0)]


def test_the_parent_clocks_the_phase_the_child_marks_on_its_channel(tmp_path):
    script = ("import sys, time\n"
              "from autograder.engine import channel\n"
              "link = channel.Link(sys.argv[1])\n"
              "link.send('mark', phase='start')\n"
              "time.sleep(0.3)\n"
              "link.send('mark', phase='end')\n")
    endpoint = channel.Endpoint(str(tmp_path))
    limits = sandbox.Limits(wall_s=20, isolate_network=False, limit_address_space=False)
    result = sandbox.run_sandboxed([sys.executable, "-c", script, endpoint.path], limits=limits, cwd=str(tmp_path),
                                   env={"PYTHONPATH": os.pathsep.join(sys.path)})
    received = endpoint.close()
    assert result.ok, result
    wall, why = speed.phase_wall(speed.timing_marks(received.marks))
    assert not why and 0.28 <= wall < 5


@pytest.mark.parametrize("patch", ["timing-clock", "timing-function", "event-method", "perf-counter", "synchronize"])
def test_a_clock_replaced_after_the_child_bound_it_is_tampering(monkeypatch, patch):
    bound = child._Instruments(child._speed_instruments())
    target, name = {"timing-clock": (timing, "_perf_counter"), "timing-function": (timing, "_event_sample"),
                    "event-method": (torch.cuda.Event, "elapsed_time"), "perf-counter": (time, "perf_counter"),
                    "synchronize": (torch.cuda, "synchronize")}[patch]
    monkeypatch.setattr(target, name, lambda *a, **k: 0.0)
    with pytest.raises(child.Tampered, match=name):
        bound.verify()


def test_the_child_binds_every_function_of_the_timing_path():
    bound = child._Instruments(child._speed_instruments())
    bound.verify()
    # Every private function of the module but the one that formats numbers for people.
    functions = {name for name, value in vars(timing).items() if callable(value) and name.startswith("_")
                 and getattr(value, "__module__", None) == timing.__name__} - {"_format_seconds"}
    assert functions and functions <= set(child.TIMING_FUNCTIONS)


def _item(name: str, speed_item: bool) -> Item:
    return Item(name, 1, (), lambda *a: {}, kind="speed" if speed_item else "correctness")


def test_speed_items_run_alone_after_every_other_item():
    items = [_item("a", False), _item("fast", True), _item("b", False), _item("c", False), _item("quick", True),
             _item("d", False)]
    spans, lock = {}, threading.Lock()
    # The shared items meet in pairs: run one at a time, the first would wait in vain and break it.
    pair = threading.Barrier(2, timeout=30)

    def grade_one(item):
        began = time.monotonic()
        if not item.is_speed:
            pair.wait()
        with lock:
            spans[item.name] = (began, time.monotonic())
        return grade.ItemResult(item.name, 0.0, 1.0, "failed", item.name)

    results = grade.run_items(items, grade_one, parallel=2)
    assert [r.item for r in results] == [it.name for it in items]
    for timed in ("fast", "quick"):
        start, end = spans[timed]
        others = [spans[it.name] for it in items if it.name != timed]
        assert all(e <= start or s >= end for s, e in others), f"{timed} shared the machine"


def test_nbgrader_runs_beside_the_items_in_one_of_their_slots_and_ends_before_the_speed_items():
    items = [_item("a", False), _item("fast", True), _item("b", False), _item("c", False)]
    spans, lock = {}, threading.Lock()
    running, most = 0, 0
    shared_done = threading.Event()

    def span(name, body):
        nonlocal running, most
        began = time.monotonic()
        with lock:
            running += 1
            most = max(most, running)
        body()
        with lock:
            running -= 1
            spans[name] = (began, time.monotonic())

    def grade_one(item):
        span(item.name, lambda: time.sleep(0.01))
        if len(spans.keys() & set("abc")) == 3:
            shared_done.set()
        return grade.ItemResult(item.name, 0.0, 1.0, "failed", item.name)

    def nbgrader():
        # It ends only once the three shared items have: run before or after them, it would wait in vain.
        span("nbgrader", lambda: shared_done.wait(timeout=30))

    results = grade.run_items(items, grade_one, parallel=2, alongside=nbgrader)
    assert [r.item for r in results] == [it.name for it in items]
    # Beside the items: all three shared items ran, one at a time, while nbgrader ran...
    assert shared_done.is_set()
    assert all(spans[n][1] <= spans["nbgrader"][1] for n in "abc")
    # ...in its slot, so never more processes at once than ``parallel``...
    assert most == 2
    # ...and the speed item waited for it.
    assert spans["fast"][0] >= spans["nbgrader"][1]


def test_what_runs_beside_the_items_raises_after_they_end():
    ended = []

    def grade_one(item):
        time.sleep(0.05)
        ended.append(item.name)
        return grade.ItemResult(item.name, 0.0, 1.0, "failed", item.name)

    def broken():
        raise RuntimeError("nbgrader fault")

    with pytest.raises(RuntimeError, match="nbgrader fault"):
        grade.run_items([_item("a", False), _item("b", False), _item("fast", True)], grade_one, parallel=2,
                        alongside=broken)
    assert sorted(ended) == ["a", "b"]


def _graded(timed: dict, marks: list) -> grade.ItemResult:
    from autograder.engine.items import Verdict

    item = Item("matmul_speed", 2, (), lambda *a: {}, check=lambda *a: Verdict.passed(), kind="speed")
    return grade._speed_result(item, {}, timed, {"reps": ROUND, "min_speedup": 1.5}, {"name": "h100"}, marks)


def test_the_engine_grades_consistent_samples_and_refuses_the_rest():
    timed = {"outputs": [], "candidate_s": [1e-3] * ROUND, "baseline_s": [2e-3] * ROUND, "candidate_batch": 1,
             "baseline_batch": 1}
    honest = _graded(timed, [("start", 5.0), ("end", 5.02)])
    assert honest.status == "passed" and honest.details["phase_wall_s"] == pytest.approx(0.02)
    inflated = _graded({**timed, "baseline_s": [0.5] * ROUND}, [("start", 5.0), ("end", 5.2)])
    assert inflated.status == "tampered" and inflated.score == 0 and "more than the 0.2 s" in inflated.reason
    unannounced = _graded(timed, [("start", 5.0)])
    assert unannounced.status == "tampered" and "out of protocol" in unannounced.reason
    empty = _graded({**timed, "candidate_s": [0.0] * ROUND}, [("start", 5.0), ("end", 5.02)])
    assert empty.status == "failed" and "no positive timings" in empty.reason


def _never_graded(*_):
    raise AssertionError("a refused lab must not reach a child")


@pytest.mark.parametrize("extra, words", [
    ({}, "must be clocked"),  # whole cells of student Python
    ({"artefacts": ("step",)}, "must be clocked"),  # extracted Python
    ({"kernels": ("k",), "artefacts": ("step",)}, "must be clocked"),  # a kernel beside Python
    ({"reference": None, "clocked": object()}, "needs a reference"),
])
def test_the_engine_refuses_a_speed_item_that_would_time_student_python_in_its_own_process(tmp_path, extra, words):
    from autograder.engine.items import LabSpec

    item = Item("step_speed", 2, ("step_code",), _never_graded, kind="speed", **extra)
    lab = LabSpec("99_refused", [item])
    with pytest.raises(grade.ConfigurationError, match=words):
        grade.grade_submission(lab, tmp_path / "missing.ipynb", release=tmp_path / "release.ipynb", profile={},
                               seed=1, student_package=tmp_path)


def test_every_speed_item_of_the_course_is_a_kernel_item_or_clocked():
    from autograder.engine.items import all_labs

    speed_items = [(lab, item) for lab in all_labs().values() for item in lab.items if item.is_speed]
    assert len(speed_items) >= 9
    for lab, item in speed_items:
        grade.refuse_misconfigured(lab, item)  # raises for any other
        assert item.clocked is not None or (item.kernels and not item.artefacts), item.name


def test_a_clocked_calls_withheld_inputs_stay_with_the_grader():
    from autograder.engine.items import Clocked

    def call_inputs(seed, params, i):
        return {"X": [seed, i], "labels": [i, i + 1]}

    clocked = Clocked(call_inputs, lambda ns, inputs: None, lambda ns, inputs: None, withheld=("labels",))
    sent, kept = grade.call_arguments(clocked, 7, {}, 2)
    assert sent == {"X": [7, 2]} and kept == {"labels": [2, 3]}
    assert grade.call_arguments(Clocked(call_inputs, None, None), 7, {}, 2) == ({"X": [7, 2], "labels": [2, 3]}, {})
