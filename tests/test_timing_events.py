"""The CUDA-event path of fastdl_lab.timing, on a simulated device: no GPU needed.

The fake device keeps a queue per stream on a fake host clock: calls put work on it, events stamp
the moment the queue reaches them, ``synchronize`` advances the host clock to the end of all
queued work. That is enough to see where the harness records events and where it waits.
"""

from __future__ import annotations

import pytest

from fastdl_lab import device, timing


class FakeDevice:
    def __init__(self):
        self.now = 0.0  # host clock, seconds
        self.busy_until = {"current": 0.0, "side": 0.0}  # when each stream's queued work ends
        self.log: list[tuple] = []
        self.launch_s = 20e-6  # host time a launch or event record costs
        self.idle_sync_s = 5e-6

    # --- what the harness calls ---------------------------------------------------------------
    def perf_counter(self) -> float:
        return self.now

    def launch(self, seconds: float, stream: str = "current", name: str = "call") -> None:
        self.now += self.launch_s
        start = max(self.now, self.busy_until[stream])
        self.busy_until[stream] = start + seconds
        self.log.append((name, stream))

    def record(self, event) -> None:
        self.now += self.launch_s
        event.at = max(self.now, self.busy_until["current"])
        self.log.append(("record", event.id))

    def elapsed_ms(self, start, end) -> float:
        assert self.now >= end.at, "an event was read before the device reached it"
        return (end.at - start.at) * 1e3

    def wait_event(self, event) -> None:
        self.now = max(self.now, event.at)

    def synchronize(self) -> None:
        self.log.append(("synchronize",))
        self.now = max([self.now, *self.busy_until.values()]) + self.idle_sync_s

    def event_class(self):
        fake, counter = self, iter(range(10**6))

        class Event:
            def __init__(self, enable_timing: bool = False):
                self.id, self.at = next(counter), None

        return Event


@pytest.fixture
def fake(monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(device, "has_gpu", lambda: True)
    monkeypatch.setattr(device, "synchronize", dev.synchronize)
    monkeypatch.setattr(timing, "_flusher", lambda enabled: lambda: dev.launch(40e-6, name="flush"))
    for name, value in {"_perf_counter": dev.perf_counter, "_Event": dev.event_class(), "_record": dev.record,
                        "_elapsed_ms": dev.elapsed_ms, "_wait_event": dev.wait_event,
                        "_synchronize": dev.synchronize}.items():
        monkeypatch.setattr(timing, name, value)
    return dev


def test_events_bracket_each_call_and_the_round_synchronises_once_after_its_last_end_event(fake):
    phases = []

    def phase(name):
        phases.append((name, len(fake.log)))

    result = timing.compare(lambda: fake.launch(300e-6, name="candidate"), lambda: fake.launch(600e-6, name="baseline"),
                            warmup=1, reps=4, phase=phase)
    timed = fake.log[phases[0][1]:phases[1][1]]
    # Per sample: flush, start event, the call, end event; nothing waits in between.
    samples = [timed[i:i + 4] for i in range(0, 8 * 4, 4)]
    for flush, start, call, end in samples:
        assert flush[0] == "flush" and start[0] == "record" and end[0] == "record"
        assert call[0] in ("candidate", "baseline")
    # Then the round's device-wide synchronize (and one more, on an idle device, for its cost).
    assert timed[32:] == [("synchronize",), ("synchronize",)]
    # Launches queue behind the flush, so events time the device work alone, not the host.
    assert result.candidate.samples == pytest.approx([300e-6] * 4)
    assert result.baseline.samples == pytest.approx([600e-6] * 4)
    assert result.speedup == pytest.approx(2.0)


def test_an_end_event_recorded_after_a_synchronize_would_time_the_host(fake):
    """The bug the harness had: the sample is launch + sync + record, not the call."""
    start, end = fake.event_class()(), fake.event_class()()
    fake.record(start)
    fake.launch(300e-6)
    fake.synchronize()
    fake.record(end)
    fake.synchronize()
    assert fake.elapsed_ms(start, end) / 1e3 > 300e-6 + fake.launch_s


def test_work_left_on_a_side_stream_is_refused_not_left_out(fake):
    def forks():
        fake.launch(50e-6)
        fake.launch(2e-3, stream="side")  # never joined back to the current stream

    with pytest.raises(timing.UnjoinedWork, match="join the side stream"):
        timing.compare(forks, lambda: fake.launch(300e-6), warmup=1, reps=3)


def test_a_call_that_forks_only_once_timed_is_refused_by_the_rounds_synchronize(fake):
    calls = []

    def forks_late():
        calls.append(None)
        fake.launch(50e-6)
        if len(calls) > 2:  # well behaved in the warm-up and the probe
            fake.launch(2e-3, stream="side")

    with pytest.raises(timing.UnjoinedWork, match="a round of timed calls"):
        timing.compare(forks_late, lambda: fake.launch(300e-6), warmup=1, reps=3)


def test_work_joined_back_from_a_side_stream_is_timed(fake):
    def forks_and_joins():
        fake.launch(50e-6)
        # side.wait_stream(current): the side stream starts where the call does.
        fake.busy_until["side"] = max(fake.busy_until.values())
        fake.launch(2e-3, stream="side")
        # wait_stream: the current stream continues only once the side stream's work is done.
        fake.busy_until["current"] = max(fake.busy_until.values())

    result = timing.compare(forks_and_joins, lambda: fake.launch(300e-6), warmup=1, reps=3)
    assert min(result.candidate.samples) >= 2e-3


def test_host_clock_path_announces_the_phase_after_the_warm_up():
    seen = []
    timing.compare(lambda: seen.append("call"), lambda: seen.append("call"), warmup=2, reps=3,
                   phase=seen.append)
    start, end = seen.index("start"), seen.index("end")
    assert start >= 4 and end == len(seen) - 1 and seen.count("start") == seen.count("end") == 1


def test_compare_adds_whole_rounds_until_each_side_has_run_min_run_s(fake):
    result = timing.compare(lambda: fake.launch(1e-3), lambda: fake.launch(2e-3), warmup=0, reps=3, min_run_s=0.01)
    assert result.candidate.n == result.baseline.n == 12  # 4 rounds: the candidate's 1 ms calls set the pace
