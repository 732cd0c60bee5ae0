import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autograder.strip import STUB, strip_solutions
from fastdl_lab import amp, checks

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("name, dtype, bits, exponent, mantissa, subnormal", [
    ("fp32", torch.float32, 32, 8, 23, 2.0**-149),
    ("fp16", torch.float16, 16, 5, 10, 2.0**-24),
    ("bf16", torch.bfloat16, 16, 8, 7, 2.0**-133),
    ("fp8_e4m3", torch.float8_e4m3fn, 8, 4, 3, 2.0**-9),
    ("fp8_e5m2", torch.float8_e5m2, 8, 5, 2, 2.0**-16),
])
def test_formats_agree_with_finfo(name, dtype, bits, exponent, mantissa, subnormal):
    fmt, info = amp.FORMATS[name], torch.finfo(dtype)
    assert (fmt.dtype, fmt.bits, fmt.exponent_bits, fmt.mantissa_bits) == (dtype, bits, exponent, mantissa)
    assert (fmt.max, fmt.smallest_normal, fmt.eps) == (info.max, info.smallest_normal, info.eps)
    assert fmt.smallest_subnormal == subnormal and fmt.storage_bytes == dtype.itemsize
    # The smallest subnormal exists, and half of it (a tie) rounds to zero, the even neighbour.
    assert float(amp.round_to(subnormal, name)) == subnormal
    assert float(amp.round_to(subnormal / 2, name)) == 0.0
    assert float(amp.round_to(subnormal * 0.51, name)) == subnormal


def test_tf32_facts_are_derived_from_fp32():
    tf32, fp32 = amp.FORMATS["tf32"], amp.FORMATS["fp32"]
    assert (tf32.bits, tf32.exponent_bits, tf32.mantissa_bits, tf32.storage_bytes) == (19, 8, 10, 4)
    assert tf32.max == (2 - 2.0**-10) * 2.0**127 and tf32.eps == 2.0**-10
    assert tf32.smallest_normal == fp32.smallest_normal and tf32.smallest_subnormal == 2.0**-136


def test_limits_by_experiment():
    def r(x, name):
        return float(amp.round_to(x, name))

    assert r(65504.0, "fp16") == 65504.0 and r(65519.0, "fp16") == 65504.0
    assert r(65520.0, "fp16") == math.inf  # half a unit (16) above the max rounds up, out of range
    assert r(3.3895313892515355e38, "bf16") == amp.FORMATS["bf16"].max and r(3.4e38, "bf16") == math.inf
    assert 3.38e38 < amp.FORMATS["bf16"].max < 3.4e38
    assert r(448.0, "fp8_e4m3") == 448.0
    # e4m3 has no inf: this torch's cast saturates at 448 (a NaN would also be honest).
    assert r(1e4, "fp8_e4m3") == 448.0 or math.isnan(r(1e4, "fp8_e4m3"))
    assert r(57344.0, "fp8_e5m2") == 57344.0 and r(61440.0, "fp8_e5m2") == math.inf
    # eps: 1 + eps is the next value after 1, and 1 + eps / 2 ties back to 1.
    for name, fmt in amp.FORMATS.items():
        assert r(1 + fmt.eps, name) == 1 + fmt.eps and r(1 + fmt.eps / 2, name) == 1.0, name


def test_tf32_rounds_to_nearest_even():
    x = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-11 + 2.0**-20, -(1 + 3 * 2.0**-11)])
    assert amp.round_to(x, "tf32").tolist() == [1.0, 1 + 2.0**-9, 1 + 2.0**-10, -(1 + 2.0**-9)]
    special = amp.round_to(torch.tensor([3.4028234663852886e38, math.inf, -math.inf]), "tf32")
    assert special.tolist() == [math.inf, math.inf, -math.inf]
    nan = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # payload only in the low bits
    assert torch.isnan(amp.round_to(nan, "tf32")).all()
    # Nearest: never further than truncation (checks.truncate_to_tf32), and within half a unit.
    v = checks.randn(10_000, seed=3) * 100
    rounded, truncated = amp.round_to(v, "tf32"), checks.truncate_to_tf32(v)
    assert ((rounded - v).abs() <= (truncated - v).abs()).all()
    assert ((rounded - v).abs() <= v.abs() * 2.0**-11).all()


def test_overflow_experiment():
    out = amp.overflow_experiment()
    first = out["first_inf"]
    assert first["fp16"] == 11.5 and first["fp8_e5m2"] == 11.5  # exp(11) = 59874 still fits
    assert first["bf16"] == first["fp32"] == first["tf32"] == 89.0  # exp(88.72) is fp32's max
    assert out["largest_finite"]["fp16"] == pytest.approx(math.exp(11), rel=1e-3)
    assert len(out["values"]["bf16"]) == len(out["x"]) == 201


def test_gradient_underflow_and_bf16_needs_no_scaling():
    plain = amp.gradient_underflow()
    zero = plain["zero"]
    # log2|g| ~ N(-20, 5): fp16 flushes what lies below 2^-25, a sixth of the values.
    assert 0.12 < zero["fp16"] < 0.2
    assert zero["fp8_e4m3"] > 0.95 and zero["fp8_e5m2"] > 0.6
    assert zero["bf16"] == zero["fp32"] == 0.0
    assert all(v == 0.0 for v in plain["overflow"].values())
    # A scale of 2^10 lifts the histogram ten binades: fp16 keeps almost everything.
    assert amp.gradient_underflow(2.0**10)["zero"]["fp16"] < 0.01
    # A scale of 2^40 sends fp16's top into inf, while bf16, with fp32's exponent, keeps it all.
    big = amp.gradient_underflow(2.0**40)
    assert big["overflow"]["fp16"] > 0.5 and big["overflow"]["bf16"] == 0.0 and big["zero"]["bf16"] == 0.0
    bf16, fp32, fp16 = amp.FORMATS["bf16"], amp.FORMATS["fp32"], amp.FORMATS["fp16"]
    assert bf16.smallest_normal == fp32.smallest_normal and bf16.max / fp32.max > 0.99
    # 40 binades from fp16's smallest subnormal to its max; bf16 spans 261, fp32 277.
    assert round(fp16.binades) == 40 and round(bf16.binades) == 261 and round(fp32.binades) == 277


def test_update_lost_in_bf16_and_fp16_but_not_fp32():
    out = amp.lost_update_experiment(w=1.0, lr=1e-3, grad=1e-2, steps=1000)
    assert out["first_step"]["bf16"] == 0.0 and out["final"]["bf16"] == 1.0
    assert out["first_step"]["fp16"] == 0.0 and out["final"]["fp16"] == 1.0
    assert out["first_step"]["fp32"] == pytest.approx(-1e-5, rel=0.01)
    assert abs(out["final"]["fp32"] - out["expected"]) < 1e-4 and out["expected"] == pytest.approx(0.99)


def test_long_sum_stagnates_in_fp16():
    out = amp.long_sum_experiment(n=100_000)
    assert out["fp16"] == 2048.0  # beyond 2048 fp16 values are 2 apart: adding x < 1 changes nothing
    assert out["exact"] / out["fp16"] > 20
    assert out["fp32"] == pytest.approx(out["exact"], rel=1e-4)
    assert out["fp16_inputs_fp32_sum"] == pytest.approx(out["exact"], rel=1e-3)
    assert len(out["curve"]["fp16"]) == 100 and out["curve"]["count"][-1] == 100_000


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        amp.round_to(1.0, "fp4")


# --------------------------------------------------------------------------------------------
# Loss scalers


def _dynamic(ours: bool, **kwargs):
    return amp.DynamicLossScaler("cpu", **kwargs) if ours else torch.amp.GradScaler("cpu", **kwargs)


RUNS = {
    # Growth after 3 clean steps (step 2), an overflow right after it (3), a NaN straight after
    # that (4), growth again (7) and another overflow (8).
    "inject": ({"init_scale": 2.0**10, "growth_interval": 3}, {"inject": {3: "inf", 4: "nan", 8: "inf"}}),
    # Unscale and clip every step; overflows at the very start and three in a row; factors that
    # are not powers of two, so the scale rounds in fp32 as torch's does.
    "clip": ({"init_scale": 1000.0, "growth_factor": 3.0, "backoff_factor": 0.3, "growth_interval": 3},
             {"inject": {0: "nan", 1: "inf", 5: "inf", 6: "inf", 7: "nan"}, "max_norm": 0.5}),
    # Nothing injected: a scale of 2^24 overflows fp16 by itself until backed off to 2^18; growth
    # to 2^19 at step 8 overflows again at step 9.
    "natural": ({"init_scale": 2.0**24, "growth_interval": 3}, {}),
}


@pytest.mark.parametrize("run", RUNS)
def test_dynamic_scaler_matches_torch_step_for_step(run):
    kwargs, script = RUNS[run]
    ours = amp.scripted_run(_dynamic(True, **kwargs), steps=14, **script)
    theirs = amp.scripted_run(_dynamic(False, **kwargs), steps=14, **script)
    assert ours["scale"] == theirs["scale"]
    assert ours["skipped"] == theirs["skipped"] and any(ours["skipped"]) and not all(ours["skipped"])
    assert ours["loss"] == theirs["loss"]
    for mine, torchs in zip(ours["params"], theirs["params"]):
        assert torch.equal(mine, torchs)
    assert ours["state"] == theirs["state"]


def test_scripted_scale_history_by_hand():
    out = amp.scripted_run(_dynamic(True, **RUNS["inject"][0]), steps=14, **RUNS["inject"][1])
    assert out["scale"] == [2.0**k for k in (10, 10, 11, 10, 9, 9, 9, 10, 9, 9, 9, 10, 10, 10)]
    assert [i for i, s in enumerate(out["skipped"]) if s] == [3, 4, 8]
    natural = amp.scripted_run(_dynamic(True, **RUNS["natural"][0]), steps=14)
    assert [i for i, s in enumerate(natural["skipped"]) if s] == [0, 1, 2, 3, 4, 5, 9]


def test_growth_tracker_and_skipped_flags_follow_torch():
    ours, theirs = _dynamic(True, init_scale=4.0, growth_interval=2), _dynamic(False, init_scale=4.0, growth_interval=2)
    w = nn.Parameter(torch.ones(3))
    opts = [torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)]
    for step, poison in enumerate([1.0, 1.0, 1.0, math.inf, 1.0, math.nan, 1.0, 1.0]):
        for scaler, opt in zip((ours, theirs), opts):
            w.grad = scaler.scale(torch.full((3,), 2.0)) * poison
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale()
        assert ours.get_growth_tracker() == theirs._get_growth_tracker(), step
    assert ours.skipped == [False, False, False, True, False, True, False, False]


def test_growth_that_would_overflow_fp32_is_not_applied():
    for ours in (True, False):
        scaler = _dynamic(ours, init_scale=2.0**127, growth_interval=1)
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        w.grad = scaler.scale(torch.ones(2))
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**127


def test_static_scaler():
    scaler = amp.StaticLossScaler(2.0**10)
    assert torch.equal(scaler.scale(torch.tensor(3.0)), torch.tensor(3072.0))
    run = amp.scripted_run(scaler, steps=8, inject={2: "inf", 3: "nan"})
    assert run["scale"] == [1024.0] * 8 and run["skipped"] == [False, False, True, True] + [False] * 4
    assert scaler.skipped == run["skipped"] and all(p.isfinite().all() for p in run["params"])
    # Scaling by a power of two is exact: with no overflow, the run equals an unscaled one.
    scaled = amp.scripted_run(amp.StaticLossScaler(2.0**10), steps=6, dtype=torch.bfloat16)
    plain = amp.scripted_run(amp.StaticLossScaler(enabled=False), steps=6, dtype=torch.bfloat16)
    for a, b in zip(scaled["params"], plain["params"]):
        assert torch.equal(a, b)
    # A scale too large for fp16 skips every step and never adapts.
    stuck = amp.scripted_run(amp.StaticLossScaler(2.0**24), steps=4)
    assert all(stuck["skipped"]) and stuck["scale"] == [2.0**24] * 4


def test_scale_takes_nested_outputs_like_torch():
    outputs = [torch.tensor(1.5), (torch.tensor([2.0, 3.0]), [torch.tensor(0.25, dtype=torch.float16)])]
    ours, theirs = _dynamic(True, init_scale=8.0).scale(outputs), _dynamic(False, init_scale=8.0).scale(outputs)
    assert type(ours) is list and type(ours[1]) is tuple and type(ours[1][1]) is list
    flat = [ours[0], ours[1][0], ours[1][1][0]]
    expected = [theirs[0], theirs[1][0], theirs[1][1][0]]
    for a, b in zip(flat, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="tensor"):
        amp.DynamicLossScaler().scale("loss")


def _one_grad(scaler):
    w = nn.Parameter(torch.ones(2))
    unused = nn.Parameter(torch.ones(2))  # no grad: ignored
    opt = torch.optim.SGD([{"params": [unused]}, {"params": [w]}], lr=0.1)
    w.grad = torch.full((2,), 64.0)
    return w, opt


def test_unscale_then_step_contract():
    scaler = amp.DynamicLossScaler(init_scale=32.0)
    w, opt = _one_grad(scaler)
    scaler.unscale_(opt)
    assert w.grad.tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    assert scaler.step(opt) is None and w.tolist() == pytest.approx([0.8, 0.8])  # not unscaled twice
    with pytest.raises(RuntimeError, match="step"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called since the last update"):
        scaler.step(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="no inf/NaN check"):
        scaler.update()
    with pytest.raises(RuntimeError, match="closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_step_returns_the_optimizers_value_or_none_when_skipped():
    class Counting(torch.optim.SGD):
        def step(self, closure=None, tag=None):
            super().step()
            return tag

    scaler = amp.DynamicLossScaler(init_scale=4.0)
    w = nn.Parameter(torch.ones(2))
    opt = Counting([w], lr=0.1)
    w.grad = torch.ones(2)
    assert scaler.step(opt, tag="stepped") == "stepped"
    scaler.update()
    w.grad = torch.tensor([1.0, math.nan])
    assert scaler.step(opt, tag="stepped") is None and w.tolist() == pytest.approx([0.975, 0.975])
    scaler.update()
    assert scaler.get_scale() == 2.0 and scaler.skipped == [False, True]


def test_fp16_gradients_are_refused():
    scaler = amp.DynamicLossScaler()
    w = nn.Parameter(torch.ones(2, dtype=torch.float16))
    w.grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(ValueError, match="fp16"):
        scaler.unscale_(torch.optim.SGD([w], lr=0.1))


@pytest.mark.parametrize("kwargs, message", [
    ({"growth_factor": 1.0}, "growth_factor"), ({"growth_factor": 0.5}, "growth_factor"),
    ({"backoff_factor": 1.0}, "backoff_factor"), ({"backoff_factor": 0.0}, "backoff_factor"),
    ({"backoff_factor": -0.5}, "backoff_factor"), ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 2.5}, "growth_interval"), ({"growth_interval": True}, "growth_interval"),
])
def test_bad_factors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        amp.DynamicLossScaler("cpu", **kwargs)


def test_state_dict_round_trips_with_torch():
    ours = _dynamic(True, init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=3)
    amp.scripted_run(ours, steps=4, inject={1: "inf"})  # a clean step, a backoff, two clean steps
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state_dict() == ours.state_dict()
    fresh = amp.DynamicLossScaler()
    fresh.load_state_dict(theirs.state_dict())
    assert fresh.state_dict() == ours.state_dict() and fresh.get_growth_tracker() == 2


def test_disabled_scaler_passes_through():
    scaler = amp.DynamicLossScaler(enabled=False)
    loss = torch.tensor(2.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and not scaler.is_enabled()
    w, opt = _one_grad(scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == pytest.approx([-5.4, -5.4]) and scaler.state_dict() == {} and scaler.skipped == []
    with pytest.raises(RuntimeError, match="empty"):
        amp.DynamicLossScaler().load_state_dict({})


def test_no_gradscaler_is_built_without_a_device():
    # A GradScaler given no device assumes CUDA and, where there is none, silently disables itself.
    pattern = re.compile(r"GradScaler\(\s*(\)|(?!device\s*=)[A-Za-z_]+\s*=)")
    name = "GradScaler"  # split, so that this file's own examples are no match
    assert pattern.search(name + "()") and pattern.search(name + "(init_scale=2.0)")
    assert not pattern.search(name + '("cpu", init_scale=2.0)') and not pattern.search(name + "(dev)")
    assert not pattern.search(name + '(device="cpu")')
    sources = [*(ROOT / "fastdl_lab").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"), Path(__file__)]
    offenders = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in sources for m in pattern.finditer(p.read_text())]
    assert not offenders


# --------------------------------------------------------------------------------------------
# Training steps


def _setup(seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 5))
    x, y = checks.randn(16, 12, seed=1), checks.randn(16, 5, seed=2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), x, y


def _reference_amp_loop(model, opt, scaler, x, y, dtype, max_norm, steps):
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_train_step_amp_equals_the_reference_loop(dtype):
    runs = []
    for which in ("reference", "torch scaler", "our scaler"):
        model, opt, x, y = _setup()
        make = (lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12)) if which != "our scaler" else (
            lambda: amp.DynamicLossScaler("cpu", init_scale=2.0**12))
        scaler = make()
        if which == "reference":
            losses = _reference_amp_loop(model, opt, scaler, x, y, dtype, 0.5, 5)
        else:
            losses = [amp.train_step_amp(model, opt, scaler, x, y, F.mse_loss, dtype=dtype, max_norm=0.5)
                      for _ in range(5)]
        assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
        assert all(isinstance(v, float) for v in losses)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    for losses, params in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(params, runs[0][1]))
    assert runs[0][0][-1] < runs[0][0][0]


def test_train_step_fp32_and_bf16_without_scaling_track_each_other():
    model, opt, x, y = _setup()
    fp32 = [amp.train_step_fp32(model, opt, x, y, F.mse_loss) for _ in range(20)]
    model, opt, x, y = _setup()
    off = torch.amp.GradScaler("cpu", enabled=False)
    bf16 = [amp.train_step_amp(model, opt, off, x, y, F.mse_loss) for _ in range(20)]
    assert fp32[-1] < 0.5 * fp32[0]
    assert bf16 != fp32 and all(abs(a - b) <= 0.05 * b for a, b in zip(bf16, fp32))


# --------------------------------------------------------------------------------------------
# The model fp16 cannot train unscaled


def test_underflow_experiment():
    plain = amp.underflow_experiment(steps=40)
    assert min(plain["zero_fraction"]) >= 0.9
    assert plain["loss"][-1] > 0.95 * plain["loss"][0] and plain["scale"] == [1.0] * 40
    scaled = amp.underflow_experiment(steps=40, scaler=amp.DynamicLossScaler("cpu"))
    assert scaled["loss"][-1] < 0.5 * scaled["loss"][0] and max(scaled["zero_fraction"]) < 0.01
    torch_scaled = amp.underflow_experiment(steps=40, scaler=torch.amp.GradScaler("cpu"))
    assert torch_scaled["loss"] == scaled["loss"]
    fp32 = amp.underflow_experiment(steps=40, dtype=torch.float32)
    assert max(fp32["zero_fraction"]) < 0.01
    ratio_fp32, ratio_fp16 = (r["loss"][-1] / r["loss"][0] for r in (fp32, scaled))
    assert abs(ratio_fp32 - ratio_fp16) < 0.02
    assert all(abs(a - b) <= 0.02 * b for a, b in zip(scaled["loss"], fp32["loss"]))


# --------------------------------------------------------------------------------------------
# Bytes per parameter


def test_calculator_on_every_recipe():
    expected = {
        "fp32_adam": (4, 4, 0, 8), "mixed_fp16_master_adam": (2, 2, 4, 8),
        "mixed_bf16_master_adam_fp32_grads": (2, 4, 4, 8), "pure_bf16_adam": (2, 2, 0, 4),
        "bf16_fp32_moments": (2, 2, 0, 8), "bf16_master_8bit_adam": (2, 2, 4, 2 * (1 + 4 / 2048)),
        "sgd_momentum_fp32": (4, 4, 0, 4), "sgd_fp32": (4, 4, 0, 0),
    }
    assert set(expected) == set(amp.RECIPES)
    for name, (params, grads, master, optimizer) in expected.items():
        got = amp.bytes_per_param_ref(amp.RECIPES[name])
        assert got == {"params": params, "grads": grads, "master": master, "optimizer": optimizer,
                       "total": params + grads + master + optimizer}, name
    totals = {name: amp.bytes_per_param_ref(r)["total"] for name, r in amp.RECIPES.items()}
    assert (totals["fp32_adam"], totals["mixed_fp16_master_adam"], totals["mixed_bf16_master_adam_fp32_grads"],
            totals["pure_bf16_adam"], totals["bf16_fp32_moments"]) == (16, 16, 18, 8, 12)
    assert totals["bf16_master_8bit_adam"] == pytest.approx(10.00390625)
    small_blocks = {**amp.RECIPES["bf16_master_8bit_adam"], "block": 256}
    assert amp.bytes_per_param_ref(small_blocks)["optimizer"] == 2 * (1 + 4 / 256)
    fp8 = {"param": "fp8_e4m3", "grad": "fp8_e5m2", "master": "fp32", "optimizer": "adamw", "moments": "tf32"}
    assert amp.bytes_per_param_ref(fp8)["total"] == 1 + 1 + 4 + 8


@pytest.mark.parametrize("change, key", [
    ({"param": "fp12"}, "'param'"), ({"grad": None}, "'grad'"), ({"master": "double"}, "'master'"),
    ({"optimizer": "lion"}, "'optimizer'"), ({"moments": None}, "'moments'"), ({"moments": "int4"}, "'moments'"),
    ({"block": 0}, "'block'"), ({"moment": "fp32"}, "moment"),
])
def test_bad_recipes_name_the_key(change, key):
    with pytest.raises(ValueError, match=key):
        amp.bytes_per_param_ref({**amp.RECIPES["fp32_adam"], **change})
    missing = dict(amp.RECIPES["fp32_adam"])
    del missing["optimizer"]
    with pytest.raises(ValueError, match="'optimizer'"):
        amp.bytes_per_param_ref(missing)


def _mlp(dtype=torch.float32):
    # 37 * 50 + 50 + 50 * 13 + 13 = 2563 parameters: sizes that divide nothing evenly.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(37, 50), nn.ReLU(), nn.Linear(50, 13)).to(dtype)


def _backward(model):
    dtype = next(model.parameters()).dtype
    model(checks.randn(8, 37, seed=1, dtype=dtype)).float().square().mean().backward()


def _check_against(measured, recipe):
    expected = amp.bytes_per_param_ref(recipe)
    for key in ("params", "grads", "master", "optimizer", "total"):
        assert measured[key] == pytest.approx(expected[key]), (key, measured, expected)


@pytest.mark.parametrize("recipe, make_optimizer", [
    ("fp32_adam", lambda p: torch.optim.AdamW(p)),
    ("sgd_momentum_fp32", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
    ("sgd_fp32", lambda p: torch.optim.SGD(p, lr=0.1)),
])
def test_training_bytes_of_fp32_recipes(recipe, make_optimizer):
    model = _mlp()
    opt = make_optimizer(model.parameters())
    _backward(model)
    opt.step()
    measured = amp.training_bytes(model, opt)
    assert measured["numel"] == 2563
    _check_against(measured, amp.RECIPES[recipe])
    # AdamW's per-tensor step counters: one fp32 scalar for each of the 4 parameter tensors.
    assert measured["step_bytes"] == (16 if recipe == "fp32_adam" else 0)


def test_training_bytes_of_pure_bf16_adamw():
    model = _mlp(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    _backward(model)
    opt.step()
    _check_against(amp.training_bytes(model, opt), amp.RECIPES["pure_bf16_adam"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_training_bytes_with_fp32_masters(dtype):
    model = _mlp(dtype)
    params = list(model.parameters())
    masters = [p.detach().float() for p in params]
    opt = torch.optim.AdamW(masters)
    low = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    for _ in range(2):
        _backward(model)
        # Right after backward: low-precision parameters and gradients, fp32 masters and moments.
        on_paper = {"param": low, "grad": low, "master": "fp32", "optimizer": "adamw", "moments": "fp32"}
        if opt.state:
            _check_against(amp.training_bytes(model, opt, masters), on_paper)
        # The gradients move to the masters in fp32 and the low-precision ones are freed: the
        # recipe that keeps fp32 gradients.
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        _check_against(amp.training_bytes(model, opt, masters),
                       {**on_paper, "grad": "fp32"} if dtype == torch.float16
                       else amp.RECIPES["mixed_bf16_master_adam_fp32_grads"])
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    assert amp.bytes_per_param_ref(on_paper)["total"] == 16


def test_training_bytes_counts_shared_storage_once():
    model = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 10, bias=False))
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 10)).sum().backward()
    out = amp.training_bytes(model, opt)
    assert out["numel"] == 100 and out["params"] == 4.0 and out["grads"] == 4.0


# --------------------------------------------------------------------------------------------
# Student copy and self-check


def test_solution_regions_strip_to_stubs():
    sources = (ROOT / "fastdl_lab" / "amp").glob("*.py")
    stripped = {p.name: strip_solutions(p.read_text(), where=str(p)) for p in sources}
    for text in stripped.values():
        compile(text, "<stripped>", "exec")
    for name, function, count in (("training.py", "train_step_amp", 1), ("memory.py", "bytes_per_param_ref", 1),
                                  ("scaler.py", "DynamicLossScaler", 3)):
        assert stripped[name].count(STUB) == count, name
        assert f"{'def' if count == 1 else 'class'} {function}" in stripped[name]
    assert "self._growth_tracker == self.growth_interval" not in stripped["scaler.py"]
    assert "scaler.unscale_(optimizer)" not in stripped["training.py"]


def test_check_passes(capsys):
    amp.check()
    assert "checks passed" in capsys.readouterr().out


def test_fresh_against_reused_output_is_timed_as_an_ab_pair():
    from fastdl_lab import memory

    cmp = memory.fresh_vs_reused(1, reps=4)
    assert cmp.candidate.n == cmp.baseline.n == 4 and cmp.candidate.median > 0 and cmp.baseline.median > 0


@pytest.mark.gpu
def test_the_caching_allocator_reuses_the_temporary_after_the_first_step():
    from fastdl_lab import memory

    rows = memory.caching_allocator_steps(steps=4, megabytes=64)
    assert rows is not None
    assert all(r["reserved"] == rows[0]["reserved"] for r in rows)
    assert all(r["driver_mallocs"] == rows[0]["driver_mallocs"] for r in rows)


def test_the_caching_allocator_figures_need_a_gpu():
    from fastdl_lab import device, memory

    if device.has_gpu():
        pytest.skip("this machine has a GPU: the gpu-marked test covers it")
    assert memory.caching_allocator_steps() is None
