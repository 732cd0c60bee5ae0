"""Lab 00 measure: roofline arithmetic, the simulated asynchronous device, benchmark records."""

import csv
import math
import time

import pytest

from fastdl_lab import device, measure

OP, COMPILE = 0.01, 0.3


def test_matmul_counts():
    assert measure.matmul_flops_ref(2, 3, 4) == 48
    assert measure.matmul_bytes_ref(2, 3, 4, 4) == (8 + 12 + 6) * 4
    # Square fp16 GEMM: 2n^3 FLOPs over 3n^2 x 2 bytes, so n/3 FLOP per byte.
    n = 4096
    ai = measure.arithmetic_intensity_ref(measure.matmul_flops_ref(n, n, n), measure.matmul_bytes_ref(n, n, n, 2))
    assert ai == pytest.approx(n / 3)


def test_roofline_and_mfu():
    # 2000 GB/s feeds 2 TFLOP/s at 1 FLOP/B; the roofs meet at 50 FLOP/B for a 100 TFLOP/s peak.
    assert measure.attainable_tflops_ref(1.0, 100.0, 2000.0) == pytest.approx(2.0)
    assert measure.attainable_tflops_ref(50.0, 100.0, 2000.0) == pytest.approx(100.0)
    assert measure.attainable_tflops_ref(1e4, 100.0, 2000.0) == 100.0
    h100 = device.PEAKS["h100"]
    ridge = h100.fp16_tflops * 1e3 / h100.mem_bw_gbs
    assert measure.attainable_tflops_ref(ridge, h100.fp16_tflops, h100.mem_bw_gbs) == pytest.approx(h100.fp16_tflops)
    assert measure.mfu_ref(400.0, 989.4) == pytest.approx(0.4043, abs=1e-4)


def _intensity(b, d_in, d_out, e):
    return measure.arithmetic_intensity_ref(measure.matmul_flops_ref(b, d_out, d_in),
                                            measure.matmul_bytes_ref(b, d_out, d_in, e))


@pytest.mark.parametrize("d_in, d_out, e, peak, bw", [
    (1024, 1024, 2, 100.0, 1000.0), (4096, 4096, 2, 989.4, 3350.0), (8192, 1024, 1, 1979.0, 3350.0),
    (4096, 4096, 4, 67.0, 3350.0), (300, 7000, 2, 50.0, 2000.0), (64, 64, 4, 1.0, 1000.0),
])
def test_compute_bound_batch_is_the_first_batch_past_the_ridge(d_in, d_out, e, peak, bw):
    ridge = peak * 1e3 / bw
    b = measure.compute_bound_batch_ref(d_in, d_out, e, peak, bw)
    assert b >= 1 and _intensity(b, d_in, d_out, e) >= ridge
    assert b == 1 or _intensity(b - 1, d_in, d_out, e) < ridge


def test_a_layer_too_narrow_for_the_ridge_never_becomes_compute_bound():
    # The intensity's ceiling, 2 d_in d_out / ((d_in + d_out) e), is 50 FLOP/B here: below a ridge of 100.
    assert measure.compute_bound_batch_ref(100, 100, 2, 100.0, 1000.0) is None
    assert _intensity(10**9, 100, 100, 2) < 100
    # Exactly at the ceiling: reached only in the limit, so never.
    assert measure.compute_bound_batch_ref(100, 100, 2, 50.0, 1000.0) is None


def test_peaks_table_lists_course_gpus():
    table = measure.peaks_table()
    assert set(table.index) == {"h100", "h200", "a100", "l4", "t4"}
    assert table.loc["a100", "ridge fp16"] == pytest.approx(312.0 * 1e3 / 2039.0)


def test_plot_roofline_draws_roofs_and_points():
    roof = device.Roofline(bandwidth_gbs=100.0, tflops=1.0, dtype=None, source="test", device="toy")
    ax = measure.plot_roofline(roof, {"add": (1 / 12, 0.005), "gemm": (100.0, 0.8)})
    assert len(ax.lines) >= 3 and len(ax.collections) == 2
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    with pytest.raises(ValueError, match="positive"):
        measure.plot_roofline(roof, {"bad": (0.0, 1.0)})


def test_launch_returns_before_work_and_synchronize_waits():
    with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=0.0) as dev:
        start = time.perf_counter()
        dev.launch()
        dev.launch()
        enqueued = time.perf_counter() - start
        assert dev.pending >= 1 and enqueued < OP
        dev.synchronize()
        assert dev.pending == 0 and time.perf_counter() - start >= 2 * OP
        assert dev.launched == dev.completed == 2


def test_first_launch_pays_compile_time():
    with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        first = time.perf_counter() - start
        start = time.perf_counter()
        dev.launch()
        dev.synchronize()
        second = time.perf_counter() - start
    assert first >= OP + COMPILE
    assert OP <= second < COMPILE


def test_result_waits_like_item_and_errors_surface_at_sync():
    with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=0.0) as dev:
        dev.launch(lambda: 42)
        assert dev.result() == 42 and dev.pending == 0
        dev.launch()
        assert dev.result() == 2  # ops finished so far
        dev.launch(lambda: 1 / 0)
        with pytest.raises(RuntimeError, match="failed") as info:
            dev.synchronize()
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(RuntimeError, match="closed"):
        dev.launch()


def test_time_op_ref_samples_are_per_iteration_and_warm():
    with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
        samples = measure.time_op_ref(dev, iters=5, warmup=2)
        assert dev.launched == 7 and dev.pending == 0
    assert len(samples) == 5
    assert all(OP <= s < COMPILE for s in samples)


def test_naive_loop_is_far_too_small():
    with measure.SimulatedAsyncDevice(op_seconds=OP, compile_seconds=COMPILE) as dev:
        naive = measure.time_op_naive(dev, 10)
        # The timer stopped while work was still queued.
        assert dev.pending > 0
    assert len(naive) == 10 and max(naive) < OP / 10


def test_append_results_keeps_one_header(tmp_path):
    rows = [{"op": "x", "median_s": 1.0}, {"op": "y", "median_s": 2.0}]
    path = measure.append_results("demo", rows, directory=tmp_path)
    measure.append_results("demo", rows[:1], directory=tmp_path)
    with path.open() as f:
        records = list(csv.DictReader(f))
    assert [r["op"] for r in records] == ["x", "y", "x"]
    assert records[0]["device_kind"] in ("cpu", "cuda") and records[0]["torch"]
    assert not math.isnan(float(records[1]["median_s"]))
    with pytest.raises(ValueError, match="columns"):
        measure.append_results("demo", [{"other": 1}], directory=tmp_path)
