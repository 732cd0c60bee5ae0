"""Lab 02's compiler section: Dynamo's graph breaks on a data-dependent branch, TORCH_LOGS from a
fresh interpreter, a trace that freezes a branch against a script that keeps it, and the
reduce-overhead timings that need a GPU."""

import pytest
import torch

from fastdl_lab import compiler, device


def test_a_branch_on_tensor_values_breaks_the_graph_once():
    found = compiler.graph_breaks(compiler.data_dependent, torch.randn(8))
    assert (found.graphs, found.breaks) == (2, 1)
    assert "`if y.sum() > 0:`" in found.reasons[0] and "compiler.py:" in found.reasons[0]


def test_the_branchless_form_is_one_graph():
    def branchless(x, scale=2.0):
        y = torch.sin(x) * scale
        return torch.where(y.sum() > 0, y.cos(), y.exp())

    found = compiler.graph_breaks(branchless, torch.randn(8))
    assert (found.graphs, found.breaks, found.reasons) == (1, 0, [])
    x = torch.randn(8)
    torch.testing.assert_close(branchless(x), compiler.data_dependent(x))


@pytest.mark.slow
def test_torch_logs_name_the_break_and_each_recompiles_guard():
    lines = compiler.torch_logs()
    text = "\n".join(lines)
    assert all(line.startswith("[") for line in lines)  # the timestamp prefix is gone
    assert "Graph break in user code" in text and "Data-dependent branching" in text
    assert "scale == 2.0" in text and "dtype mismatch" in text
    with pytest.raises(RuntimeError, match="failed"):
        compiler.torch_logs("raise SystemExit(3)")


def test_a_trace_freezes_the_branch_its_example_took():
    probe = compiler.trace_vs_script(compiler.sign_scale, torch.ones(4), -torch.arange(1.0, 5.0))
    out = probe["outputs"]
    torch.testing.assert_close(out["scripted"], out["eager"])
    torch.testing.assert_close(out["traced"], -2 * out["eager"])  # 2x on a negative input, not -x
    assert "if" not in probe["traced_code"] and "if" in probe["scripted_code"]
    assert any("Python boolean" in w for w in probe["warnings"]["trace"])
    assert probe["warnings"]["calls"] == []  # the wrong answer comes back without a word
    # On the side the example took, the trace is right.
    same_side = compiler.trace_vs_script(compiler.sign_scale, torch.ones(4), torch.arange(1.0, 5.0))["outputs"]
    torch.testing.assert_close(same_side["traced"], same_side["eager"])


def test_tiny_layers_are_a_relu_stack():
    run, x = compiler.tiny_layers(depth=3, width=8, batch=2)
    out = run(x)
    assert out.shape == (2, 8) and (out >= 0).all()


def test_reduce_overhead_needs_a_gpu():
    if device.has_gpu():
        pytest.skip("a GPU is here: the gpu test runs it")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        compiler.reduce_overhead_timings()


@pytest.mark.gpu
def test_reduce_overhead_runs_and_matches_eager():
    results = compiler.reduce_overhead_timings(depth=4, reps=3)
    assert set(results) == {"eager", "compiled", "reduce-overhead"}
