"""Lab 02 fusion: Conv+BN folding, ConvBN with recompute, saved-tensor bytes, the experiments' code."""

import pytest
import torch
from torch import nn

from fastdl_lab import checks, device, fusion


def _conv_bn(in_ch, out_ch, kernel, *, bias, affine=True, seed=0, **conv_kw):
    torch.manual_seed(seed)
    conv = nn.Conv2d(in_ch, out_ch, kernel, bias=bias, **conv_kw)
    bn = nn.BatchNorm2d(out_ch, eps=1e-3, affine=affine)
    # Statistics far from the defaults, as after training, so the fold has something to do.
    bn.running_mean.normal_(0.0, 0.5)
    bn.running_var.uniform_(0.1, 3.0)
    if affine:
        nn.init.uniform_(bn.weight, 0.3, 2.0)
        nn.init.normal_(bn.bias, 0.0, 0.5)
    return conv.eval(), bn.eval()


CONFIGS = [
    dict(padding=1),
    dict(stride=2, padding=0),
    dict(stride=(2, 1), padding=2, dilation=2),
    dict(padding=1, groups=2),
    dict(padding="same", padding_mode="reflect"),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("conv_kw", CONFIGS)
def test_folded_conv_equals_conv_then_bn(bias, conv_kw):
    conv, bn = _conv_bn(4, 6, 3, bias=bias, **conv_kw)
    x = checks.randn(2, 4, 13, 11, seed=1)
    folded = fusion.fold_conv_bn_ref(conv, bn)
    assert isinstance(folded, nn.Conv2d) and folded.bias is not None and not folded.training
    assert (folded.stride, folded.padding, folded.dilation, folded.groups, folded.padding_mode) == \
        (conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
    with torch.no_grad():
        checks.assert_close(folded(x), bn(conv(x)), atol=1e-5, rtol=1e-5)


def test_fold_is_exact_in_float64_and_handles_bn_without_affine():
    conv, bn = _conv_bn(3, 5, 3, bias=True, affine=False, padding=1)
    conv, bn = conv.double(), bn.double()
    x = checks.randn(2, 3, 9, 9, seed=2, dtype=torch.float64)
    with torch.no_grad():
        checks.assert_close(fusion.fold_conv_bn_ref(conv, bn)(x), bn(conv(x)), atol=1e-12, rtol=1e-12)


def test_fold_refuses_what_cannot_be_folded():
    conv, _ = _conv_bn(3, 5, 3, bias=False)
    with pytest.raises(ValueError, match="running statistics"):
        fusion.fold_conv_bn_ref(conv, nn.BatchNorm2d(5, track_running_stats=False))
    with pytest.raises(ValueError, match="channels"):
        fusion.fold_conv_bn_ref(conv, nn.BatchNorm2d(4).eval())


def test_fold_model_matches_the_eval_model_and_leaves_it_alone():
    model = fusion.small_cnn(seed=3)
    images = checks.randn(4, 3, 32, 32, seed=4)
    folded = fusion.fold_model(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.modules())
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 3
    with torch.no_grad():
        checks.assert_close(folded(images), model(images), atol=1e-5, rtol=1e-4)
    # A folding function can be passed in, as the lab does with the student's.
    calls = []
    fusion.fold_model(model, fold=lambda c, b: calls.append(1) or fusion.fold_conv_bn_ref(c, b))
    assert len(calls) == 3


def test_fold_model_reaches_nested_sequentials_only():
    inner = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    model = nn.Sequential(inner, nn.ReLU(), nn.Conv2d(4, 4, 1), nn.ReLU(), nn.BatchNorm2d(4))
    folded = fusion.fold_model(model)
    assert isinstance(folded[0][1], nn.Identity)
    # Not adjacent: the ReLU between them keeps this BatchNorm.
    assert isinstance(folded[4], nn.BatchNorm2d)


CONVBN_CASES = [((8, 16, 32, 32), 32, 1, 1), ((3, 5, 11, 9), 7, 2, 0), ((2, 4, 10, 10), 6, 1, 2)]


@pytest.mark.parametrize("shape, out_ch, stride, padding", CONVBN_CASES)
def test_conv_bn_train_matches_reference(shape, out_ch, stride, padding):
    batch, in_ch, size = shape[0], shape[1], shape[2]
    x = checks.randn(*shape, seed=5).requires_grad_()
    _, w, gamma, beta = fusion.convbn_operands(batch, in_ch, out_ch, size, seed=6)
    args = (x, w, gamma, beta)
    results = []
    for fn in (fusion.conv_bn_train_ref, fusion.conv_bn_train):
        out = fn(*args, eps=1e-3, stride=stride, padding=padding)
        # A random upstream gradient: sum(out) or sum(out**2) make BatchNorm's input gradient zero.
        upstream = checks.randn(out.shape, seed=7)
        results.append([out, *torch.autograd.grad(out, args, upstream)])
    for name, got, want in zip(["out", "x", "conv_weight", "bn_weight", "bn_bias"], results[1], results[0]):
        checks.assert_close(got, want, atol=1e-4, rtol=1e-4, name=name)


def test_conv_bn_train_gradcheck_float64():
    args = fusion.convbn_operands(2, 2, 3, 5, dtype=torch.float64, seed=8)
    assert torch.autograd.gradcheck(lambda *a: fusion.conv_bn_train(*a, 1e-5, 1, 1), args)
    assert torch.autograd.gradcheck(lambda *a: fusion.conv_bn_train(*a, 1e-5, 2, 0), args)


def test_conv_bn_train_skips_gradients_nobody_asked_for():
    x, w, gamma, beta = fusion.convbn_operands(2, 3, 4, 6, seed=9)
    out = fusion.conv_bn_train(x.detach(), w, gamma, beta)
    grads = torch.autograd.grad(out, (w, gamma, beta), checks.randn(out.shape, seed=10))
    assert [g.shape for g in grads] == [w.shape, gamma.shape, beta.shape]


def test_recompute_saves_the_conv_output_and_nothing_else():
    args = fusion.convbn_operands()  # the lab's case: x 8x16x32x32, 3x3 conv 16 -> 32 channels
    x_bytes, w_bytes = 8 * 16 * 32 * 32 * 4, 32 * 16 * 9 * 4
    y_bytes, per_channel = 8 * 32 * 32 * 32 * 4, 32 * 4
    ref = fusion.saved_tensor_bytes(fusion.conv_bn_train_ref, *args)
    new = fusion.saved_tensor_bytes(fusion.conv_bn_train, *args)
    # Reference: x and the weight for the conv; y, gamma, batch mean and inverse std for BN.
    assert ref == x_bytes + w_bytes + y_bytes + 3 * per_channel
    # Recompute: x, the weight, gamma, and the two statistics.
    assert new == x_bytes + w_bytes + 3 * per_channel
    assert new / ref <= 0.6


def test_saved_bytes_count_each_storage_once():
    a = torch.randn(1000, requires_grad=True)
    # a * a saves a twice: one buffer.
    assert fusion.saved_tensor_bytes(lambda t: t * t, a) == 4000
    # sin saves its input: here a view of two rows, which keeps all 100 rows alive.
    big = torch.randn(100, 10, requires_grad=True)
    assert fusion.saved_tensor_bytes(lambda t: t[:2].sin(), big) == 4000
    # Nothing needs a gradient: nothing is saved.
    assert fusion.saved_tensor_bytes(lambda t: t * t, a.detach()) == 0


def test_peak_memory_needs_a_gpu():
    args = fusion.convbn_operands(2, 3, 4, 6)
    peak = fusion.peak_memory_bytes(fusion.conv_bn_train_ref, *args)
    assert (peak is None) == (not device.has_gpu())


def test_repeated_multiply_and_pointwise_chain():
    x = checks.randn(1000, seed=11)
    assert fusion.repeated_multiply(x, 0) is x
    checks.assert_close(fusion.repeated_multiply(x, 4), x * fusion.FACTOR**4)
    y = fusion.pointwise_chain(x)
    t = torch.relu((x * 0.5 + 1.0) * x) - 0.25
    checks.assert_close(y, torch.sigmoid(t * t) + x)


def test_overhead_probe_rows():
    rows = fusion.overhead_probe(n_ops=10, sizes=(1, 64))
    assert [(r["what"], r["elements"]) for r in rows] == [("python float add", 1), ("torch add", 1), ("torch add", 64)]
    assert all(r["per_op_s"] > 0 for r in rows)


@pytest.mark.slow
def test_compiled_repeated_multiply_matches_eager():
    # The only torch.compile in the tests (15-25 s cold): one k, reused by the curve below.
    x = checks.randn(4096, seed=12)
    checks.assert_close(fusion.repeated_multiply_compiled(3)(x), fusion.repeated_multiply(x, 3))
    assert fusion.repeated_multiply_compiled(3) is fusion.repeated_multiply_compiled(3)
    (row,) = fusion.repeated_multiply_curve([3], n=4096, reps=1)
    assert row["k"] == 3 and row["n"] == 4096 and row["compiled_s"] > 0 and row["eager_s"] > 0
    assert row["flop_per_s"] == pytest.approx(3 * 4096 / row["compiled_s"])
