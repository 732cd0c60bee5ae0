"""Lab 10's model, data and step: counts that equal what PyTorch counts, parts that change nothing
but what they compute, training that learns, memory split by what holds it."""

import pytest
import torch
import torch.nn.functional as F

# Before anything that imports Triton (FlopCounterMode does): the package switches Triton's
# interpreter on when there is no GPU, which only works before Triton is first imported.
from fastdl_lab.capstone import data, model, step
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

SMALL = model.GPTConfig(vocab_size=256, seq_len=32, d_model=48, n_head=3, n_layer=2)


def _math_attention(q, k, v):
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def _no_mask_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def test_the_stated_sizes_of_the_two_configurations():
    # The module says about 0.8 M parameters for the CPU size and about 350 M for the GPU size.
    assert model.param_count(model.CPU_CONFIG) == 842_496
    assert 345e6 < model.param_count(model.GPU_CONFIG) < 360e6


@pytest.mark.parametrize("config", [SMALL, model.CPU_CONFIG, model.GPTConfig(vocab_size=300, seq_len=16, d_model=40,
                                                                             n_head=5, n_layer=3, mlp_ratio=2)])
def test_the_parameter_count_is_the_models_with_the_tied_matrix_once(config):
    gpt = model.build(config)
    assert sum(p.numel() for p in gpt.parameters()) == model.param_count(config)
    assert gpt.head.weight is gpt.tok_emb.weight


def test_the_flop_formula_is_what_flopcountermode_counts():
    gpt = model.build(SMALL, attention=_math_attention)
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    with FlopCounterMode(display=False) as counter:
        gpt(idx)
    assert counter.get_total_flops() == model.matmul_flops_per_token(SMALL)["total"] * idx.numel()


def test_the_same_seed_gives_the_same_weights_whatever_the_parts():
    a = model.build(SMALL, seed=3)
    b = model.build(SMALL, layernorm="course-pytorch", attention=_math_attention, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(model.build(SMALL, seed=4).tok_emb.weight, a.tok_emb.weight)


def test_the_courses_pytorch_parts_compute_what_torchs_do_and_a_missing_mask_does_not():
    idx = torch.randint(0, SMALL.vocab_size, (3, SMALL.seq_len), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, parts in {"torch": {}, "course": {"layernorm": "course-pytorch", "attention": "course-pytorch"},
                        "no mask": {"attention": _no_mask_attention}}.items():
        gpt = model.build(SMALL, **parts)
        logits, loss = gpt(idx, idx.roll(-1, 1))
        loss.backward()
        results[name] = (logits.detach(), gpt.tok_emb.weight.grad)
    torch.testing.assert_close(results["course"][0], results["torch"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["course"][1], results["torch"][1], atol=1e-5, rtol=1e-5)
    assert (results["no mask"][0] - results["torch"][0]).abs().max() > 1e-3


def test_parts_are_named_or_given():
    with pytest.raises(ValueError, match="layernorm must be one of"):
        model.build(SMALL, layernorm="apex")
    with pytest.raises(ValueError, match="multiple of n_head"):
        model.GPTConfig(d_model=50, n_head=4)
    with pytest.raises(ValueError, match="positions for 32"):
        model.build(SMALL)(torch.zeros(1, 33, dtype=torch.long))


def test_batches_are_next_byte_windows_the_same_for_a_seed():
    first = list(data.batches("train", 2, 4, 16, seed=5))
    again = list(data.batches("train", 2, 4, 16, seed=5))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    x, y = first[0]
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and len(data.split("val")) * 9 <= len(data.split("train")) + 9
    with pytest.raises(ValueError, match="'train' or 'val'"):
        data.split("test")


def test_training_learns_and_the_courses_adamw_follows_torchs():
    runs = {}
    for name in ("torch", "course-foreach"):
        gpt = model.build(SMALL)
        runs[name] = step.train(gpt, step.make_optimizer(gpt, name), 25, 8)
    assert runs["torch"][-1] < runs["torch"][0] - 1.0
    # The held-out bytes see the same improvement: an untrained model scores near ln 256.
    trained = model.build(SMALL)
    step.train(trained, step.make_optimizer(trained), 25, 8)
    assert step.validation_loss(trained, 8) < step.validation_loss(model.build(SMALL), 8) - 0.5
    assert runs["course-foreach"] == pytest.approx(runs["torch"], abs=1e-4)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        step.make_optimizer(model.build(SMALL), "lion")


def test_the_memory_split_counts_each_holder_and_activations_grow_with_the_batch():
    splits = {}
    for batch_size in (4, 8):
        gpt = model.build(SMALL)
        splits[batch_size] = step.memory_split(gpt, step.make_optimizer(gpt), batch_size)
    weights = 4 * model.param_count(SMALL)
    for split in splits.values():
        assert split["weights"] == split["grads"] == weights and split["optimizer"] == 2 * weights
    assert splits[8]["activations"] == pytest.approx(2 * splits[4]["activations"], rel=0.02)


def test_throughput_reports_tokens_and_mfu_only_against_a_peak():
    gpt = model.build(SMALL)
    result = step.step_throughput(gpt, step.make_optimizer(gpt), 4, reps=3)
    assert result["mfu"] is None and result["tokens_per_s"] == pytest.approx(4 * SMALL.seq_len / result["seconds"])
    assert result["flops"] == 3 * model.matmul_flops_per_token(SMALL)["total"] * 4 * SMALL.seq_len
    with_peak = step.step_throughput(gpt, step.make_optimizer(gpt), 4, reps=3, peak_flops=1e12)
    assert 0 < with_peak["mfu"] < 1


def test_the_courses_triton_kernels_assemble_into_the_same_model():
    # The interpreter runs the kernels on a CPU: one block, 16 tokens, two heads of 16.
    config = model.GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_head=2, n_layer=1)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for parts in ("torch", "course-triton"):
        gpt = model.build(config, layernorm=parts, attention=parts)
        logits, loss = gpt(idx, idx.roll(-1, 1))
        loss.backward()
        out[parts] = (logits.detach(), gpt.blocks[0].attn.qkv.weight.grad, gpt.blocks[0].ln1.weight.grad)
    for got, expected in zip(out["course-triton"], out["torch"]):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_checkpointing_trades_saved_activations_block_by_block():
    from fastdl_lab.capstone import experiments

    rows = experiments.checkpointing_sweep(SMALL, 4, reps=2)
    assert [r["recompute_blocks"] for r in rows] == list(range(SMALL.n_layer + 1))
    saved = [r["activation_bytes"] for r in rows]
    assert all(a > b for a, b in zip(saved, saved[1:]))
    # Equal blocks save equal bytes: each recomputed block gives back the same amount.
    assert saved[0] - saved[1] == saved[1] - saved[2]
    fig = experiments.plot_checkpointing(rows)
    assert list(fig.axes[0].lines[0].get_ydata()) == [b / 2**20 for b in saved]


def test_bf16_autocast_tracks_fp32_training_and_saves_less():
    from fastdl_lab.capstone import experiments

    runs = experiments.precision_runs(SMALL, 4, 12, reps=2)
    fp32, bf16 = runs["fp32"], runs["bf16 autocast"]
    assert bf16["losses"] == pytest.approx(fp32["losses"], abs=0.05)
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.5
    assert bf16["activation_bytes"] < fp32["activation_bytes"]
    assert len(experiments.plot_precision(runs).axes[0].lines) == 2


def test_compile_runs_report_the_graphs_and_the_steps():
    from fastdl_lab.capstone import experiments

    # aot_eager traces forward and backward as inductor would, without generating code: seconds, not minutes.
    out = experiments.compile_runs(SMALL, 2, steps=3, backend="aot_eager")
    assert out["compiled"]["graphs"] == 1 and out["compiled"]["breaks"] == {}
    assert out["compiled"]["first_s"] > out["compiled"]["later_s"] > 0 and out["eager"]["later_s"] > 0
    # A branch on a tensor's value inside the model is a graph break, and is named.
    with_break = experiments.compile_runs(SMALL, 2, steps=2, backend="aot_eager",
                                          attention=lambda q, k, v: F.scaled_dot_product_attention(
                                              q, k, v, is_causal=bool(q.sum() > -1e9)))
    assert with_break["compiled"]["graphs"] > 1 and with_break["compiled"]["breaks"]


def test_autocast_is_entered_per_forward_so_each_step_sees_the_updated_weights():
    gpt = model.build(SMALL)
    gpt.autocast_dtype = torch.bfloat16
    x, y = next(data.batches("train", 1, 2, SMALL.seq_len))
    first = gpt(x)[0].detach()
    with torch.no_grad():
        gpt.blocks[0].mlp.fc.weight.mul_(2.0)
    assert first.dtype == torch.bfloat16 and not torch.equal(gpt(x)[0].detach(), first)


def test_the_flop_time_table_counts_a_steps_matmuls_exactly_and_times_every_class():
    from fastdl_lab.capstone import breakdown

    gpt = model.build(SMALL, attention="math")
    x, y = next(data.batches("train", 1, 2, SMALL.seq_len))
    rows = breakdown.flop_time_table(breakdown.training_step(gpt, x, y), steps=1)
    by_class = {r["class"]: r for r in rows}
    assert list(by_class) == list(breakdown.CLASSES)
    # A backward does two matmuls per forward one: the step is three forwards' matmul FLOPs.
    assert by_class["matmul"]["flops"] == 3 * model.matmul_flops_per_token(SMALL)["total"] * x.numel()
    assert by_class["matmul"]["flops_share"] == 1.0
    assert sum(r["time_share"] for r in rows) == pytest.approx(1.0)
    assert all(by_class[c]["time_s"] > 0 for c in ("matmul", "softmax", "layernorm", "elementwise"))
    assert breakdown.op_class("aten::addmm") == "matmul" and breakdown.op_class("aten._softmax.default") == "softmax"
    assert breakdown.op_class("aten::embedding_dense_backward") == "other"
    assert len(breakdown.plot_shares(rows).axes[0].patches) == 2 * len(rows)


@pytest.mark.parametrize("sizes, batch, attention, recomputed", [
    (dict(seq_len=24, d_model=32, n_head=2, n_layer=2), 3, "torch", 0),
    (dict(seq_len=17, d_model=24, n_head=3, n_layer=3, vocab_size=300), 2, "math", 1),
    (dict(seq_len=20, d_model=16, n_head=1, n_layer=2), 1, "torch", 2),
])
def test_the_memory_formula_is_what_the_step_holds_to_the_byte(sizes, batch, attention, recomputed):
    from fastdl_lab.capstone import accounting

    config = model.GPTConfig(**sizes)
    measured = accounting.measure(config, batch, attention=attention, recompute_blocks=recomputed)
    assert accounting.predict_memory_ref(config, batch, attention, recomputed) == measured


def test_a_prediction_that_is_not_a_finite_number_is_wholly_wrong():
    from fastdl_lab.capstone import accounting

    measured = dict.fromkeys(accounting.PARTS, 100)
    errors = accounting.relative_errors({"weights": float("nan"), "grads": "x", "optimizer": float("inf")}, measured)
    assert errors == dict.fromkeys(accounting.PARTS, 1.0)
    assert accounting.relative_errors({**measured, "activations": 103}, measured)["activations"] == pytest.approx(0.03)


def test_a_students_block_class_builds_the_model_with_the_same_weights():
    class Mine(model.Block):
        pass

    config = model.GPTConfig(seq_len=16, d_model=32, n_head=2, n_layer=2)
    theirs, ours = model.build(config, block=Mine, seed=3), model.build(config, seed=3)
    assert all(type(b) is Mine for b in theirs.blocks)
    for (name, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        assert a.equal(b), name


def test_the_benchmarks_step_and_memory_rows_are_whole_and_the_memory_is_the_formulas():
    from fastdl_lab.capstone import bench

    spec = bench.BENCHMARK["quick"]
    rows = bench.step_rows(spec, "cpu") + bench.memory_rows(spec, "cpu")
    assert [r["experiment"] for r in rows] == ["peak", "step", "step", "memory", "memory", "memory", "memory"]
    assert all(set(r) == set(bench.BENCHMARK["columns"]) and r["figure"] for r in rows)
    for r in rows[1:3]:
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"]
    assert all(r["note"] == f"predicted {r['figure']}" for r in rows[3:])
