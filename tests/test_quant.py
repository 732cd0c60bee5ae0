"""Lab 09 quantisation: int8 formats, the W8A8 Triton matmul, QAT against PTQ, Linear + BN folding."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from autograder.strip import STUB, strip_package, strip_solutions
from fastdl_lab import checks, quant
from fastdl_lab.fusion import fold_conv_bn_ref

ROOT = Path(__file__).resolve().parent.parent
QUANT = ROOT / "fastdl_lab" / "quant"
DEV = "cuda" if device.has_gpu() else "cpu"


# --------------------------------------------------------------------------------------------
# Formats


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_symmetric_round_trip_is_within_half_a_step(axis):
    w = checks.randn(30, 17, seed=1, scale=3.0)
    q, scale, zp = quant.quantize(w, axis=axis)
    assert q.dtype == torch.int8 and q.shape == w.shape and zp.dtype == torch.int32
    assert scale.shape == (() if axis is None else (w.shape[axis],))
    assert int(q.abs().max()) == 127 and not (zp != 0).any()
    err = (quant.dequantize(q, scale, zp, axis) - w).abs()
    step = scale if axis is None else scale.reshape([-1, 1] if axis == 0 else [1, -1])
    assert bool((err <= 0.5 * step * (1 + 1e-6)).all())


def test_asymmetric_stores_zero_exactly_and_uses_the_whole_grid():
    x = checks.randn(1000, seed=2).abs() * 4 + 0.5  # all positive: the range is widened to hold 0
    q, scale, zp = quant.quantize(x, symmetric=False)
    assert int(zp) == -127 and int(q.max()) == 127
    assert float(quant.dequantize(torch.tensor([int(zp)], dtype=torch.int8), scale, zp)) == 0.0
    assert float(scale) == pytest.approx(float(x.max()) / 254, rel=1e-6)
    shifted = checks.randn(40, 8, seed=3) + torch.linspace(-3, 3, 8)
    q, scale, zp = quant.quantize(shifted, symmetric=False, axis=1)
    assert zp.shape == (8,) and bool((zp >= -127).all() and (zp <= 127).all())
    assert bool(((quant.dequantize(q, scale, zp, 1) - shifted).abs() <= 0.5 * scale * (1 + 1e-6)).all())


def test_low_bits_zero_channels_and_errors():
    w = checks.randn(6, 5, seed=4)
    w[2] = 0
    q, scale, _ = quant.quantize(w, bits=4, axis=0)
    assert int(q.abs().max()) == 7 and float(scale[2]) == 1.0 and not q[2].any()
    assert quant.qrange(8) == (-127, 127) and quant.qrange(2) == (-1, 1)
    with pytest.raises(ValueError, match="bits"):
        quant.quantize(w, bits=9)
    with pytest.raises(TypeError, match="floating"):
        quant.quantize(torch.ones(3, dtype=torch.int32))


def test_error_is_zero_on_the_grid_and_grows_with_fewer_bits():
    on_grid = torch.arange(-127, 128, dtype=torch.float32) * 0.01
    assert quant.quantization_error(on_grid)["max_abs"] == pytest.approx(0.0, abs=1e-9)
    w = checks.randn(64, 64, seed=5)
    e8, e4 = quant.quantization_error(w, bits=8), quant.quantization_error(w, bits=4)
    assert e4["rel_fro"] > 10 * e8["rel_fro"]
    # About 6 dB per bit when the scale fits the data.
    assert 20 < e8["sqnr_db"] - e4["sqnr_db"] < 28


@pytest.fixture(scope="module")
def regression_mlp():
    return quant.train_regression_mlp(0)


def test_per_channel_pays_off_on_a_trained_layer_and_more_once_bn_is_folded(regression_mlp):
    trained = regression_mlp[0].weight.detach()
    folded = quant.fold_linear_bn(regression_mlp[0], regression_mlp[1]).weight.detach()
    fresh = (torch.rand(128, 32, generator=checks.generator(0)) * 2 - 1) / 32 ** 0.5  # nn.Linear's init

    def gain(w):
        return quant.quantization_error(w)["rel_fro"] / quant.quantization_error(w, axis=0)["rel_fro"]

    # Measured with seed 0: row ranges span 2.3x, 13.2x and 1.2x; per-channel error 1.3x, 2.8x
    # and ~1.0x lower than per-tensor.
    assert quant.row_range_ratio(folded) > 3 * quant.row_range_ratio(trained) > 3 * 1.5
    assert quant.row_range_ratio(fresh) < 1.5
    assert gain(folded) > 2 and 1.15 < gain(trained) < gain(folded) and gain(fresh) < 1.1
    assert torch.equal(quant.trained_layer(0), trained)


def test_quantize_per_channel_matches_quantize_and_passes_its_check(regression_mlp):
    for w in (regression_mlp[0].weight.detach(), checks.randn(8, 3, 3, 3, seed=6)):
        q, scale = quant.quantize_per_channel_ref(w)
        q2, scale2, _ = quant.quantize(w, axis=0)
        assert torch.equal(q, q2) and torch.equal(scale, scale2)
        quant.check_per_channel(q, scale, w)


def test_check_per_channel_tolerates_ties_only():
    # Row 0 puts 0.5 * scale and 2.5 * scale on the grid: exact ties, which round to even here and
    # may honestly round away from zero elsewhere.
    w = torch.tensor([[127.0, 0.5, 2.5, -3.0], [1.3, -2.0, 0.25, 0.0]])
    q, scale = quant.quantize_per_channel_ref(w)
    assert q[0, 1:3].tolist() == [0, 2]
    away = q.clone()
    away[0, 1:3] = torch.tensor([1, 3], dtype=torch.int8)
    quant.check_per_channel(away, scale, w)
    off = q.clone()
    off[1, 0] += 1
    with pytest.raises(checks.MismatchError, match="q"):
        quant.check_per_channel(off, scale, w)
    with pytest.raises(checks.MismatchError, match="scale"):
        quant.check_per_channel(q, scale * 1.01, w)
    with pytest.raises(checks.MismatchError, match="int8"):
        quant.check_per_channel(q.int(), scale, w)
    with pytest.raises(checks.MismatchError, match="two tensors"):
        quant.check_per_channel(q.tolist(), scale, w)


def test_dynamic_activation_scales_are_per_row():
    x = checks.randn(3, 5, 16, seed=7)
    x[1, 2] *= 100  # one outlier token
    scale = quant.dynamic_activation_scale(x)
    assert scale.shape == (3, 5)
    assert torch.equal(scale, x.abs().amax(dim=-1) / 127)
    q, s = quant.quantize_activation(x)
    assert q.dtype == torch.int8 and torch.equal(s, scale)
    # The outlier row gets its own scale; the others keep a fine grid.
    assert int(q[0].abs().amax(dim=-1).min()) == 127


# --------------------------------------------------------------------------------------------
# The int8 matmul


def _operands(m, n, k, seed=0):
    a_q, a_scale = quant.quantize_activation(checks.randn(m, k, seed=seed))
    w_q, w_scale, _ = quant.quantize(checks.randn(n, k, seed=seed + 1), axis=0)
    return tuple(t.contiguous().to(DEV) for t in (a_q, a_scale, w_q, w_scale))


# Single element, ragged over one and several tiles (CPU tiles are 64x64x64), exact tiles, a thin
# row, and K deep enough for integer sums past 2^24 (exact in int32, rounded once to fp32).
SHAPES = [(1, 1, 1), (37, 45, 50), (64, 64, 64), (130, 70, 200), (3, 129, 257), (65, 20, 2100)]


@pytest.mark.interpret
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_kernel_is_bit_exact(m, n, k):
    ops = _operands(m, n, k)
    out = quant.int8_matmul(*ops)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert torch.equal(out.cpu(), quant.int8_matmul_ref(*(t.cpu() for t in ops)))


@pytest.mark.interpret
def test_extreme_codes_and_small_tiles():
    a_q = torch.full((40, 300), -128, dtype=torch.int8)
    w_q = torch.randint(-128, 128, (50, 300), dtype=torch.int8, generator=checks.generator(8))
    a_scale, w_scale = torch.rand(40) + 0.5, torch.rand(50) + 0.5
    ops = tuple(t.to(DEV) for t in (a_q, a_scale, w_q, w_scale))
    # 16x16x32 tiles: a 3x4 grid and ten K steps, the last one ragged.
    for blocks in ({}, {"block_m": 16, "block_n": 16, "block_k": 32}):
        quant.check_int8_matmul(quant.int8_matmul(*ops, **blocks), *ops)


def test_reference_agrees_with_torch_integer_matmul():
    a_q, a_scale, w_q, w_scale = (t.cpu() for t in _operands(33, 17, 500, seed=9))
    acc = torch._int_mm(a_q, w_q.T)
    assert torch.equal(quant.int8_matmul_ref(a_q, a_scale, w_q, w_scale),
                       acc.float() * a_scale[:, None] * w_scale[None, :])


@pytest.mark.interpret
def test_empty_sizes():
    a_q, a_scale, w_q, w_scale = _operands(5, 6, 7)
    assert quant.int8_matmul(a_q[:0], a_scale[:0], w_q, w_scale).shape == (0, 6)
    empty_k = quant.int8_matmul(a_q[:, :0].contiguous(), a_scale, w_q[:, :0].contiguous(), w_scale)
    assert torch.equal(empty_k.cpu(), torch.zeros(5, 6))


def test_launcher_validation():
    a_q, a_scale, w_q, w_scale = _operands(8, 8, 40)
    cases = [
        ((a_q.float(), a_scale, w_q, w_scale), "a_q must be a 2-D torch.int8"),
        ((a_q, a_scale.double(), w_q, w_scale), "a_scale must be a 1-D torch.float32"),
        ((a_q, a_scale, w_q[:, :30], w_scale), "w_q holds one row"),
        ((a_q, a_scale[:5], w_q, w_scale), "one a_scale per row"),
        ((a_q, a_scale, w_q.t().contiguous().t(), w_scale), "contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            quant.int8_matmul(*args)
    with pytest.raises(TypeError):
        quant.int8_matmul(a_q.tolist(), a_scale, w_q, w_scale)
    with pytest.raises(ValueError, match="power of two"):
        quant.int8_matmul(a_q, a_scale, w_q, w_scale, block_k=16)
    deep = torch.zeros(1, quant.MAX_K + 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="overflow"):
        quant.int8_matmul_ref(deep, torch.ones(1), deep, torch.ones(1))


@triton.jit
def _scales_multiplied_first(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Right to within an ulp, but the two scales are multiplied together first: the last bit of
    # some outputs differs from the reference's left-to-right epilogue.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & ((k0 + offs_k)[None, :] < K), other=0)
        w = tl.load(w_ptr + (k0 + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                    mask=((k0 + offs_k)[:, None] < K) & (offs_n[None, :] < N), other=0)
        acc = tl.dot(a, w, acc, out_dtype=tl.int32)
    scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None] * \
        tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(tl.float32) * scale,
             mask=mask)


@pytest.mark.interpret
def test_exactness_check_sees_the_epilogue_order():
    ops = _operands(50, 40, 100, seed=10)
    out = quant.int8_matmul(*ops, kernel=_scales_multiplied_first)
    ref = quant.int8_matmul_ref(*(t.cpu() for t in ops))
    checks.assert_close(out.cpu(), ref, name="within fp32 rounding")
    with pytest.raises(checks.MismatchError, match="differ"):
        quant.check_int8_matmul(out, *ops)


@pytest.mark.interpret
def test_w8a8_linear_is_close_to_the_float_layer_and_takes_a_kernel():
    linear = nn.Linear(48, 20)
    with torch.no_grad():
        linear.weight.copy_(checks.randn(20, 48, seed=11, scale=0.2))
        linear.bias.copy_(checks.randn(20, seed=12))
    x = checks.randn(2, 7, 48, seed=13)
    layer = quant.W8A8Linear(linear).to(DEV)
    with torch.no_grad():
        want, got = linear(x), layer(x.to(DEV)).cpu()
    assert got.shape == (2, 7, 20) and layer.w_q.dtype == torch.int8
    assert float((got - want).norm() / want.norm()) < 0.02
    # The codes the layer made, on its device: CUDA divides by a Python scalar through its
    # reciprocal, so a scale computed on the CPU can differ from the GPU's in the last bit.
    a_q, a_scale = (t.cpu() for t in quant.quantize_activation(x.reshape(-1, 48).to(DEV)))
    exact = quant.int8_matmul_ref(a_q, a_scale, layer.w_q.cpu(), layer.w_scale.cpu()) + linear.bias.detach()
    assert torch.equal(got.reshape(-1, 20), exact)
    swapped = quant.quantize_linears(nn.Sequential(nn.Linear(48, 20, bias=False), nn.ReLU(), linear)).to(DEV)
    assert [type(m).__name__ for m in swapped] == ["W8A8Linear", "ReLU", "W8A8Linear"]
    assert swapped[0].bias is None and swapped[0](x[0].to(DEV)).shape == (7, 20)
    other = quant.W8A8Linear(linear, kernel=_scales_multiplied_first).to(DEV)
    assert not torch.equal(other(x.to(DEV)).cpu(), got)


# --------------------------------------------------------------------------------------------
# QAT against PTQ


def test_fake_quant_forward_and_straight_through_gradient():
    scale = torch.tensor(0.5, requires_grad=True)
    x = torch.tensor([-4.0, -1.2, 0.26, 0.74, 3.4, 3.9], requires_grad=True)
    y = quant.fake_quant(x, scale, bits=4)  # grid -7..7 steps of 0.5: [-3.5, 3.5]
    assert y.tolist() == [-3.5, -1.0, 0.5, 0.5, 3.5, 3.5]
    y.backward(torch.arange(1.0, 7.0))
    # Clamped at both ends (-8 and 8 steps); 3.4 is 6.8 steps, inside.
    assert x.grad.tolist() == [0.0, 2.0, 3.0, 4.0, 5.0, 0.0]
    assert scale.grad is None
    shifted = quant.fake_quant(torch.tensor([0.0, 1.0]), torch.tensor(0.1), zero_point=120, bits=8)
    assert torch.allclose(shifted, torch.tensor([0.0, 0.7]))  # code 130 clamps to 127
    q, s, zp = quant.quantize(checks.randn(50, seed=14))
    assert torch.equal(quant.fake_quant(quant.dequantize(q, s, zp), s), quant.dequantize(q, s, zp))
    wide = checks.randn(200, seed=15, scale=3.0)
    for zero_point, bits in ((0, 4), (17, 8), (-2, 3)):
        assert torch.equal(quant.fake_quant(wide, torch.tensor(0.07), zero_point, bits),
                           quant.round_to_grid(wide, torch.tensor(0.07), zero_point, bits))


@pytest.fixture(scope="module")
def spiral():
    """Seed 0's task and float model; measured on it: float 0.984, 4-bit PTQ 0.486, QAT 0.949."""
    return quant.make_task(0), quant.train_float(0)


def test_qat_recovers_what_ptq_loses(spiral):
    task, model = spiral
    calib = task.train[0]
    float_acc = quant.accuracy(model, task.test)
    ptq_acc = quant.accuracy(quant.ptq(model, 4, calib), task.test)
    qat_model = quant.qat(model, 4, quant.SETUP["qat_steps"], task.train, seed=1)
    qat_acc = quant.accuracy(qat_model, task.test)
    assert float_acc > 0.95 and ptq_acc < float_acc - 0.3 and qat_acc > ptq_acc + 0.3
    # 8-bit PTQ costs next to nothing, on the fake-quant path and through the int8 kernel.
    assert quant.accuracy(quant.ptq(model, 8, calib), task.test) > float_acc - 0.01
    on_device = tuple(t.to(DEV) for t in task.test)
    assert quant.accuracy(quant.quantize_linears(model).to(DEV), on_device) > float_acc - 0.01
    # The float model is left as it was.
    assert quant.accuracy(model, task.test) == float_acc


def test_qat_needs_the_straight_through_gradient(spiral):
    task, model = spiral
    ptq_acc = quant.accuracy(quant.ptq(model, 4, task.train[0]), task.test)
    # Rounding without the STE: no gradient reaches the weights, only biases move (measured 0.496).
    no_ste = quant.qat(model, 4, quant.SETUP["qat_steps"], task.train, fake_quant=quant.round_to_grid, seed=1)
    assert quant.accuracy(no_ste, task.test) < ptq_acc + 0.1


def _no_rounding(x, scale, zero_point=0, bits=8):
    return x


def test_quant_linear_trains_through_its_function_and_evaluates_by_true_rounding():
    linear = nn.Linear(6, 3)
    x = checks.randn(5, 6, seed=19)
    layer = quant.QuantLinear(linear, 4, 8, torch.tensor(0.03), _no_rounding).train()
    with torch.no_grad():
        assert torch.equal(layer(x), linear(x))
        w_scale = linear.weight.abs().max() / 7
        rounded = torch.nn.functional.linear(quant.round_to_grid(x, torch.tensor(0.03), 0, 8),
                                             quant.round_to_grid(linear.weight, w_scale, 0, 4), linear.bias)
        assert torch.equal(layer.eval()(x), rounded) and not torch.equal(rounded, linear(x))


# --------------------------------------------------------------------------------------------
# Linear + BatchNorm folding


def _random_bn(features, seed, **kw):
    bn = nn.BatchNorm1d(features, **kw)
    gen = checks.generator(seed)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(features, generator=gen))
        bn.running_var.copy_(0.2 + torch.rand(features, generator=gen))
        if bn.affine:
            bn.weight.copy_(torch.randn(features, generator=gen))
            bn.bias.copy_(torch.randn(features, generator=gen))
    return bn.eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_fold_linear_bn_is_exact(bias, affine):
    linear = nn.Linear(13, 9, bias=bias).double()
    bn = _random_bn(9, seed=15, affine=affine).double()
    x = checks.randn(6, 13, seed=16, dtype=torch.float64)
    fused = quant.fold_linear_bn(linear, bn)
    assert isinstance(fused, nn.Linear) and fused.weight.dtype == torch.float64
    with torch.no_grad():
        checks.assert_close(fused(x), bn(linear(x)), atol=1e-12, rtol=1e-12)


def test_fold_model_and_the_fold_argument():
    model = quant.bn_mlp(24, 40, depth=2, d_out=5, seed=17)
    before = [t.clone() for t in model.state_dict().values()]
    calls = []

    def counting_fold(conv, bn):
        calls.append((type(conv).__name__, type(bn).__name__))
        return fold_conv_bn_ref(conv, bn)

    folded = quant.fold_linear_bn_model(model, fold=counting_fold)
    assert calls == [("Conv2d", "BatchNorm2d")] * 2
    assert sum(isinstance(m, nn.BatchNorm1d) for m in folded.modules()) == 0
    x = checks.randn(32, 24, seed=18)
    with torch.no_grad():
        checks.assert_close(folded(x), model(x), atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))
    # Per block Linear, BatchNorm, ReLU become Linear, ReLU: one op (one pass over memory) fewer.
    assert (quant.forward_ops(model, x), quant.forward_ops(folded, x)) == (3 * 2 + 1, 2 * 2 + 1)
    with pytest.raises(TypeError, match="BatchNorm1d"):
        quant.fold_linear_bn(nn.Linear(3, 3), nn.BatchNorm2d(3))
    with pytest.raises(ValueError, match="running statistics"):
        quant.fold_linear_bn(nn.Linear(3, 3), nn.BatchNorm1d(3, track_running_stats=False))


# --------------------------------------------------------------------------------------------
# Student copy


def test_solution_regions_and_the_student_copy(tmp_path):
    for name, graded in (("formats.py", {"quantize_per_channel_ref"}), ("w8a8.py", {"_int8_matmul_kernel"}),
                         ("training.py", {"forward", "backward"}), ("fusion.py", set()), ("bench.py", set()),
                         ("__init__.py", set())):
        source = (QUANT / name).read_text()
        stripped = strip_solutions(source, where=name)
        stubbed = {node.name for node in ast.walk(ast.parse(stripped))
                   if isinstance(node, ast.FunctionDef) and STUB in ast.get_source_segment(stripped, node)}
        assert stubbed == graded, name
    # Nothing in the package calls the graded quantiser: only the grader compares against it.
    for path in QUANT.glob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and fn.name != "quantize_per_channel_ref":
                names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
                assert "quantize_per_channel_ref" not in names, f"{path.name}: {fn.name}"

    # What the notebook and the grader need runs on the student copy; the graded pieces raise,
    # and so do the defaults that stand on them (the package's kernel, the package's STE).
    strip_package(ROOT / "fastdl_lab", tmp_path / "fastdl_lab")
    script = """
import torch
from fastdl_lab import checks, quant
from fastdl_lab.fusion import fold_conv_bn_ref
w = quant.trained_layer(0, steps=20)
q, scale, _ = quant.quantize(w, axis=0)
quant.check_per_channel(q, scale, w)
a_q, a_scale = quant.quantize_activation(checks.randn(9, 32, seed=1))
quant.check_int8_matmul(quant.int8_matmul_ref(a_q, a_scale, q, scale), a_q, a_scale, q, scale)
dev = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run
task = quant.make_task(0, n_train=300, n_test=100)
model = quant.make_model(0)
quant.accuracy(quant.ptq(model, 4, task.train[0]), task.test)
quant.accuracy(quant.qat(model, 4, 3, task.train, fake_quant=quant.round_to_grid), task.test)
for call in (lambda: quant.quantize_per_channel_ref(w),
             lambda: quant.int8_matmul(*(t.to(dev) for t in (a_q, a_scale, q, scale))),
             lambda: quant.qat(model, 4, 1, task.train)):
    try:
        call()
    except Exception as exc:  # the interpreter wraps a kernel's exception in its own
        assert "graded exercise" in str(exc), exc
    else:
        raise AssertionError("a graded function ran in the student copy")
print("student copy ok")
"""
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "student copy ok" in done.stdout, done.stderr[-2000:]


def test_check_passes(capsys):
    quant.check()
    assert "checks passed" in capsys.readouterr().out


def test_channel_errors_per_tensor_hurt_the_small_channels_and_per_channel_does_not():
    from fastdl_lab.quant import formats

    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 0, 6)[:, None]
    errors = formats.channel_errors(w, bits=4)
    # With one scale for the tensor, the smallest row is rounded on the largest row's grid.
    assert errors["per tensor"][0] > 10 * errors["per channel"][0]
    assert errors["per channel"].max() < 0.2 and errors["per tensor"][-1] == pytest.approx(errors["per channel"][-1])
    ax = formats.plot_channel_errors(w, bits=4).axes[0]
    assert len(ax.lines) == 2 and len(ax.lines[0].get_ydata()) == 6


def test_decision_maps_show_ptq_losing_and_qat_recovering_accuracy():
    from fastdl_lab.quant import training

    found = training.decision_maps(0, steps=60, resolution=20)
    acc = list(found["accuracy"].values())
    assert acc[1] < acc[0] - 0.2 and acc[2] > acc[1] + 0.2
    assert all(m.shape == (20, 20) for m in found["maps"].values())
    assert len(training.plot_decision_maps(found).axes) == 3
