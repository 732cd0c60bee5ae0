import json

import pytest
import torch

from fastdl_lab.data import profile


def test_trace_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDL_TRACE_DIR", str(tmp_path / "traces"))
    assert profile.trace_dir() == tmp_path / "traces" and (tmp_path / "traces").is_dir()


@pytest.fixture(scope="module")
def toy_trace(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    folder = tmp_path_factory.mktemp("traces")
    mp.setenv("FASTDL_TRACE_DIR", str(folder))
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(48, 24), torch.randn(40, 48)

    def step():
        loss = layer(x).square().mean()
        loss.backward()
        loss.item()

    try:
        yield folder, profile.profile_steps(step, steps=3, warmup=1, name="toy step")
    finally:
        mp.undo()


def test_profile_steps_writes_a_chrome_trace(toy_trace):
    folder, path = toy_trace
    assert path.parent == folder and path.name.startswith("toy_step-") and path.suffix == ".json"
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e.get("name", "").startswith("ProfilerStep#") for e in events) == 3


def test_summary_of_a_profiled_step(toy_trace):
    _, path = toy_trace
    summary = profile.summarise_trace(path, top=5)
    # Only the three active steps are in the trace: one .item() each.
    assert summary.steps == 3 and summary.syncs["aten::item"] == 3
    assert summary.syncs["aten::_local_scalar_dense"] == 3
    names = [name for name, _, _ in summary.top_ops]
    assert len(names) == 5 and "aten::addmm" in names
    calls = {name: n for name, _, n in summary.top_ops}
    assert calls["aten::addmm"] == 3
    assert 0 < summary.busy_us <= summary.wall_us
    text = str(summary)
    assert "self µs" in text and "aten::item x3" in text


def _x(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def test_summary_arithmetic_on_a_hand_made_trace():
    trace = {"traceEvents": [
        _x("ProfilerStep#0", 0, 400, cat="user_annotation"),
        _x("outer", 0, 100), _x("inner", 10, 30), _x("leaf", 15, 5),
        _x("next", 200, 50),
        _x("late", 290, 20),
        _x("cudaStreamSynchronize", 300, 5, tid=2, cat="cuda_runtime"),
        _x("Memcpy DtoH (Device -> Pageable)", 301, 2, tid=9, cat="gpu_memcpy"),
        _x("Memcpy HtoD (Pageable -> Device)", 302, 2, tid=9, cat="gpu_memcpy"),
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1},
    ]}
    s = profile.summarise_trace(trace, gap_us=40)
    assert dict((n, (us, c)) for n, us, c in s.top_ops) == {
        "outer": (70, 1), "inner": (25, 1), "leaf": (5, 1), "next": (50, 1), "late": (20, 1)}
    assert [(g.start_us, g.length_us, g.before, g.after) for g in s.gaps] == [(100, 100, "outer", "next"),
                                                                              (250, 40, "next", "late")]
    assert s.syncs == {"cudaStreamSynchronize": 1, "Memcpy DtoH (Device -> Pageable)": 1}
    assert (s.wall_us, s.busy_us, s.steps) == (400, 170, 1)


def test_the_timeline_is_the_summarys_busy_stretches_and_gaps_as_bars():
    trace = {"traceEvents": [
        _x("ProfilerStep#0", 0, 200, cat="user_annotation"), _x("ProfilerStep#1", 200, 200, cat="user_annotation"),
        _x("outer", 0, 100), _x("inner", 10, 30), _x("next", 200, 50), _x("late", 290, 20),
    ]}
    line = profile.timeline(trace, gap_us=40)
    assert line["busy"] == [(0, 100), (200, 50), (290, 20)] and line["steps"] == [0, 200]
    assert [(g.start_us, g.length_us) for g in line["gaps"]] == [(100, 100), (250, 40)]
    assert [(g.start_us, g.length_us) for g in profile.summarise_trace(trace, gap_us=40).gaps] == [(100, 100), (250, 40)]
    ax = profile.plot_timeline(trace, gap_us=40).axes[0]
    busy, gaps = ax.collections[:2]
    assert len(busy.get_paths()) == 3 and len(gaps.get_paths()) == 2 and len(ax.lines) == 2


def test_step_flops_of_a_linear_layer():
    m, k, n = 13, 24, 7
    layer, x = torch.nn.Linear(k, n), torch.randn(m, k, requires_grad=True)
    assert profile.step_flops(lambda: layer(x)) == 2 * m * n * k
    # Backward needs two products of the same size: the gradients of the input and of the weight.
    assert profile.step_flops(lambda: layer(x).sum().backward()) == 3 * 2 * m * n * k
