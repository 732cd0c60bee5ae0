import math
import time

import pytest
import torch

from fastdl_lab import timing
from fastdl_lab.timing import Comparison, Timing


def test_timing_statistics():
    t = Timing([0.004, 0.001, 0.002, 0.003, 0.100])
    assert t.n == 5
    assert t.median == 0.003
    assert t.min == 0.001
    assert t.mean == pytest.approx(0.022)
    assert t.quartiles == pytest.approx((0.002, 0.004))
    assert t.iqr == pytest.approx(0.002)
    assert t.stdev > t.iqr
    assert t.as_dict()["median_s"] == 0.003 and t.as_dict()["n"] == 5
    assert str(t) == "3 ms ± 1 (median ± IQR/2, n=5)"
    assert Timing([2e-6]).stdev == 0.0


def test_bench_takes_reps_samples_and_excludes_warm_up():
    calls = []

    def fn():
        calls.append(None)
        # The first calls stand in for JIT compilation: much slower than the rest.
        time.sleep(0.02 if len(calls) <= 2 else 0.001)

    result = timing.bench(fn, warmup=2, reps=7)
    assert result.n == 7 and result.batch == 1
    assert len(calls) == 9
    assert max(result.samples) < 0.015


@pytest.mark.skipif(torch.cuda.is_available(), reason="host timing batches; device events time one call each")
def test_bench_batches_very_short_calls():
    calls = []
    result = timing.bench(lambda: calls.append(None), warmup=1, reps=4)
    assert result.batch > 1
    assert len(calls) == 1 + 4 * result.batch
    assert all(s > 0 for s in result.samples)


def test_bench_keeps_sampling_until_min_run_s():
    result = timing.bench(lambda: time.sleep(0.002), warmup=0, reps=2, min_run_s=0.02)
    assert result.n % 2 == 0
    assert sum(result.samples) >= 0.02


@pytest.fixture
def two_threads():
    """Two intra-op threads to start from (the suite runs with one), put back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_bench_fixes_and_restores_threads(two_threads):
    seen = []
    timing.bench(lambda: seen.append(torch.get_num_threads()), warmup=1, reps=2, threads=1)
    assert set(seen) == {1}
    assert torch.get_num_threads() == two_threads


def test_threads_are_restored_when_the_function_raises(two_threads):
    def boom():
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError):
        timing.bench(boom, threads=1)
    assert torch.get_num_threads() == two_threads


def test_bench_rejects_zero_reps():
    with pytest.raises(ValueError):
        timing.bench(lambda: None, reps=0)


def test_compare_interleaves_in_random_order():
    order = []
    # No warm-up means no batching: one call per sample, so the order is visible call by call.
    timing.compare(lambda: order.append("c"), lambda: order.append("b"), warmup=0, reps=50,
                   seed=1)
    pairs = [tuple(order[i:i + 2]) for i in range(0, len(order), 2)]
    assert len(pairs) == 50
    assert set(pairs) == {("c", "b"), ("b", "c")}


def test_compare_finds_a_two_times_speedup():
    result = timing.compare(lambda: time.sleep(0.002), lambda: time.sleep(0.004), warmup=1,
                            reps=10)
    assert 1.4 < result.speedup < 2.6
    assert result.ci_low <= result.speedup <= result.ci_high
    assert result.as_dict()["candidate"]["n"] == 10
    assert "speedup" in str(result)


def test_bootstrap_is_seeded():
    cand = Timing([1.0, 1.1, 0.9, 1.05, 0.95])
    base = Timing([2.0, 2.2, 1.9, 2.1, 2.05])
    first = Comparison.from_timings(cand, base, seed=3)
    again = Comparison.from_timings(cand, base, seed=3)
    assert (first.ci_low, first.ci_high) == (again.ci_low, again.ci_high)
    assert first.speedup == pytest.approx(2.05 / 1.0)


def test_table_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    plain = Timing([0.001, 0.002, 0.003])
    comp = Comparison.from_timings(Timing([0.001, 0.0011]), Timing([0.002, 0.0021]))
    results = {"plain": plain, "ab": comp}

    df = timing.table(results)
    assert list(df.index) == ["plain", "ab"]
    assert df.loc["plain", "median_s"] == 0.002 and df.loc["plain", "n"] == 3
    assert math.isnan(df.loc["plain", "speedup"])
    assert df.loc["ab", "speedup"] == pytest.approx(comp.speedup)

    ax = timing.plot(results, title="demo")
    assert ax.get_title() == "demo"
    assert len(ax.patches) == 3
    assert "ms" in ax.get_ylabel()


def test_plot_samples_draws_every_iteration_the_mean_and_the_truth():
    import matplotlib

    matplotlib.use("Agg")
    samples = {"naive": [1e-6] * 4, "no warm-up": [0.42, 0.02, 0.02, 0.02]}
    ax = timing.plot_samples(samples, truth_s=0.02, title="pitfalls")
    from matplotlib.collections import LineCollection, PathCollection

    # Per column: a dot per iteration, the first one ringed again, and a bar at the mean (in ms).
    points = [len(c.get_offsets()) for c in ax.collections if isinstance(c, PathCollection)]
    assert points == [4, 1, 4, 1]
    means = [c.get_segments()[0][0][1] for c in ax.collections if isinstance(c, LineCollection)]
    assert means == pytest.approx([1e-3, 120.0])
    assert ax.get_yscale() == "log" and ax.get_title() == "pitfalls"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["naive", "no warm-up"]
    assert any("0.02" in t.get_text() or "20 ms" in t.get_text() for t in ax.get_legend().get_texts())
    with pytest.raises(ValueError, match="positive"):
        timing.plot_samples({"bad": [0.0, 1.0]})
