"""Lab 00's graded items, judged in the parent: the timing loop on the grader's simulated device
(``autograder/labs/_simulated_device.py``) and the roofline's lower bound on "no batch".

The device's service and the child's handle are joined here by a link that calls the service
directly, as the channel does across the sandbox; the grading pipeline and the hostile submissions
test the same pieces through a real sandbox."""

from __future__ import annotations

import threading
import time

import pytest

from autograder.engine.items import Observed
from autograder.labs import lab00_measure as lab
from autograder.labs._simulated_device import MAX_LAUNCHES, SERVICE, DeviceService, RemoteDevice
from fastdl_lab import measure

OP, COMPILE = 0.01, 0.1


class DirectLink:
    """The channel's ``Link.call`` without the socket: a service's error comes back as RuntimeError."""

    def __init__(self, service: DeviceService):
        self.service = service
        self._lock = threading.Lock()  # one call at a time, as over the channel

    def call(self, name: str, **args):
        assert name == SERVICE
        try:
            with self._lock:
                return self.service.handle(**args)
        except Exception as exc:  # noqa: BLE001 - what the grader's endpoint would answer
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


def inputs(iters: int = 4, warmup: int = 2) -> dict:
    return {"op_seconds": OP, "compile_seconds": COMPILE, "iters": iters, "warmup": warmup}


def graded(time_op, given: dict | None = None, close: bool = True):
    """(verdict, samples): ``time_op`` run as the item's drive runs it, judged on the service's record."""
    given = given or inputs()
    service = DeviceService(given["op_seconds"], given["compile_seconds"])
    dev = RemoteDevice(DirectLink(service))
    samples = [float(s) for s in time_op(dev, iters=given["iters"], warmup=given["warmup"])]
    if close:
        dev.close()
    observed = Observed(services={SERVICE: service.record()})
    return lab.timing_check(given, samples, {}, observed=observed), samples


def test_the_reference_loop_passes_on_the_graders_record():
    verdict, samples = graded(measure.time_op_ref, inputs(iters=5, warmup=3))
    assert verdict.fraction == 1.0, verdict.reason
    assert "3 warm-up launches" in verdict.reason and len(samples) == 5


def test_the_device_runs_on_the_graders_clock():
    service = DeviceService(OP, COMPILE)
    dev = RemoteDevice(DirectLink(service))
    start = time.monotonic()
    dev.launch()
    assert time.monotonic() - start < OP / 2, "a launch returns at once"
    assert dev.pending == 1 and dev.launched == 1
    dev.synchronize()
    assert time.monotonic() - start >= OP + COMPILE, "the first op pays for the compilation"
    start = time.monotonic()
    dev.launch()
    dev.launch()
    assert dev.result() == 3 and time.monotonic() - start >= 2 * OP
    assert dev.completed == 3 and dev.pending == 0
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.launch()
    calls = [call for call, _, _ in service.record()["events"]]
    assert calls[:3] == ["info", "launch", "state"] and calls[-1] == "close"


def test_ops_run_in_the_child_and_their_errors_surface_at_the_synchronize():
    dev = RemoteDevice(DirectLink(DeviceService(0.001, 0.0)))
    dev.launch(lambda: 41)
    dev.launch(lambda: 42)
    assert dev.result() == 42
    dev.launch(lambda: 1 / 0)
    with pytest.raises(RuntimeError, match="failed") as raised:
        dev.synchronize()
    assert isinstance(raised.value.__cause__, ZeroDivisionError)
    dev.synchronize()  # the error is reported once


def test_the_service_bounds_what_a_child_can_make_the_grader_keep_or_wait_for():
    service = DeviceService(0.0, 0.0)
    for _ in range(MAX_LAUNCHES):
        service.handle(call="launch")
    with pytest.raises(RuntimeError, match="at most"):
        service.handle(call="launch")
    with pytest.raises(ValueError, match="no call"):
        service.handle(call="launch", seconds=0)
    # A wait still pending when the grader takes the record ends at once.
    slow = DeviceService(30.0, 0.0)
    slow.handle(call="launch")
    waiter = threading.Thread(target=slow.handle, kwargs={"call": "synchronize"})
    waiter.start()
    time.sleep(0.05)
    slow.record()
    waiter.join(2)
    assert not waiter.is_alive()


def no_sync(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    dev.synchronize()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        samples.append(time.perf_counter() - start)
    return samples


def sleep_for_sync(dev, iters=10, warmup=2):
    """Samples of the right size, but the waiting is the loop's own sleep, not the device's."""
    for _ in range(warmup):
        dev.launch()
    time.sleep(dev.compile_seconds + warmup * dev.op_seconds)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        time.sleep(dev.op_seconds)
        samples.append(time.perf_counter() - start)
    return samples


def one_wait_for_all(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    dev.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dev.launch()
    dev.synchronize()
    return [(time.perf_counter() - start) / iters] * iters


def no_warmup_wait(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        samples.append(time.perf_counter() - start)
    return samples


def fixed_warmup(dev, iters=10, warmup=2):
    return measure.time_op_ref(dev, iters=iters, warmup=2)


@pytest.mark.parametrize("time_op, reason", [
    (no_sync, "never waited for"),
    (sleep_for_sync, "queued behind the warm-up"),
    (one_wait_for_all, "never waited for"),
    (no_warmup_wait, "queued behind the warm-up"),
    (fixed_warmup, "launches; warmup=1"),
], ids=["no-sync", "sleep-for-sync", "one-wait-for-all", "no-warmup-wait", "fixed-warmup"])
def test_a_loop_the_device_did_not_see_is_refused(time_op, reason):
    verdict, _ = graded(time_op, inputs(warmup=1))
    assert verdict.fraction == 0 and reason in verdict.reason, verdict.reason


def shifted(by: float, which: int = 1):
    def time_op(dev, iters=10, warmup=2):
        samples = measure.time_op_ref(dev, iters=iters, warmup=warmup)
        samples[which] += by
        return samples
    return time_op


@pytest.mark.parametrize("by, reason", [(-OP / 2, "took"), (0.05, "between the device calls")])
def test_samples_the_record_cannot_explain_are_refused(by, reason):
    verdict, _ = graded(shifted(by))
    assert verdict.fraction == 0 and reason in verdict.reason and "not the loop's" in verdict.reason, verdict.reason


def test_samples_delivered_without_the_runners_close_are_refused():
    verdict, _ = graded(measure.time_op_ref, close=False)
    assert verdict.fraction == 0 and "never closed" in verdict.reason


def test_what_a_helper_thread_does_after_time_op_returned_is_not_its_loop():
    helpers = []

    def honest_loop_later(dev, iters, warmup):
        try:
            measure.time_op_ref(dev, iters, warmup)
        except RuntimeError as exc:
            helpers.append(str(exc))

    def time_op(dev, iters=10, warmup=2):
        helpers.append(threading.Thread(target=honest_loop_later, args=(dev, iters, warmup)))
        helpers[0].start()
        time.sleep(0.01)
        return [OP] * iters

    verdict, _ = graded(time_op)
    helpers[0].join(5)
    assert verdict.fraction == 0 and "launches" in verdict.reason, verdict.reason
    assert "closed" in helpers[1], "the device refuses the helper once the runner closed it"


def _roofline_outputs(given: dict, batch) -> dict:
    from fastdl_lab.measure import compute_bound_batch_ref

    ns = {name: getattr(measure, f"{name}_ref") for name in lab.CALCULATORS}
    ns["compute_bound_batch"] = batch or compute_bound_batch_ref
    return lab.roofline_drive(ns, given)


def test_roofline_answers_none_earn_nothing_unless_a_batch_is_found():
    given = lab.roofline_inputs(3, {})
    full = lab.roofline_check(given, _roofline_outputs(given, None), {})
    assert full.fraction == 1.0, full.reason
    never = lab.roofline_check(given, _roofline_outputs(given, lambda *args: None), {})
    assert never.fraction == lab.CALCULATOR_SHARE and "earns nothing" in never.reason
