"""Lab 03 layernorm: the fused kernels against the references, stability, gradients, training, checks."""

import pytest
import torch
import torch.nn.functional as F

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import checks, layernorm

DEV = "cuda" if device.has_gpu() else "cpu"
DTYPES = [torch.float32, torch.float16]


def _params(n, dtype, seed=0, requires_grad=False):
    # Weights near 1 and biases near 0, as after initialisation, but not exactly: a kernel that
    # swapped or ignored them must show.
    w = checks.randn(n, dtype=dtype, seed=seed + 1, device=DEV, scale=0.5, offset=1.0)
    b = checks.randn(n, dtype=dtype, seed=seed + 2, device=DEV, scale=0.5)
    return w.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


def _input(shape, dtype, seed=0, requires_grad=False):
    return checks.randn(shape, dtype=dtype, seed=seed, device=DEV, scale=2.0, offset=0.5).requires_grad_(requires_grad)


# One element; below the 16-wide minimum block; ragged in one block; 3-D and 4-D inputs.
SHAPES = [(1, 1), (3, 10), (37, 300), (5, 7, 100), (2, 3, 2, 33)]
# (rows, cols, block_n): rows spanning several blocks, ragged last block, and an exact multiple.
MULTI_BLOCK = [(9, 300, 32), (4, 257, 16), (6, 64, 16), (2, 3, 70, 32)]


@pytest.mark.interpret
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_reference(shape, dtype):
    x = _input(shape, dtype)
    w, b = _params(shape[-1], dtype)
    y = layernorm.layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == dtype
    layernorm.check_layer_norm(y, x, w, b, name=f"y {shape} {dtype}")


@pytest.mark.interpret
@pytest.mark.parametrize("case", MULTI_BLOCK)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_rows_spanning_several_blocks(case, dtype):
    *shape, block_n = case
    x = _input(tuple(shape), dtype, seed=5)
    w, b = _params(shape[-1], dtype, seed=5)
    layernorm.check_layer_norm(layernorm.layer_norm(x, w, b, eps=1e-3, block_n=block_n), x, w, b, eps=1e-3)


@pytest.mark.interpret
def test_saved_statistics_are_fp32_mean_and_reciprocal_std():
    x = _input((6, 300), torch.float16, requires_grad=True)
    w, b = _params(300, torch.float16)
    y = layernorm.layer_norm(x, w, b, block_n=64)
    _, _, mean, rstd = y.grad_fn.saved_tensors
    xf = x.detach().float()
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (6,)
    checks.assert_close(mean, xf.mean(-1))
    checks.assert_close(rstd, torch.rsqrt(xf.var(-1, unbiased=False) + 1e-5))


@pytest.mark.interpret
def test_strided_inputs():
    wide = _input((40, 8), torch.float32)
    w, b = _params(40, torch.float32)
    x = wide.t()  # rows of 40 elements, 8 apart in memory
    layernorm.check_layer_norm(layernorm.layer_norm(x, w, b), x, w, b)
    w2, b2 = _params(80, torch.float32)
    layernorm.check_layer_norm(layernorm.layer_norm(x.t(), w2[::10], b2[::10]), x.t(), w2[::10], b2[::10])


@pytest.mark.interpret
@pytest.mark.parametrize("block_n", [None, 16, 64])
def test_stable_where_the_naive_variance_fails(block_n):
    x = layernorm.catastrophic_input(8, 300, device=DEV)
    w, b = torch.ones(300, device=DEV), torch.zeros(300, device=DEV)
    naive = layernorm.stability_error(layernorm.naive_variance_layer_norm(x, w, b), x, w, b)
    # The input really is hard: the one-pass formula is off by far more than the bound, or NaN.
    assert naive > 100 * layernorm.STABLE_ATOL
    # ... while the bound is within reach of fp32, as PyTorch's own LayerNorm shows.
    assert layernorm.stability_error(F.layer_norm(x, (300,), w, b), x, w, b) < layernorm.STABLE_ATOL / 4
    y = layernorm.layer_norm(x, w, b, block_n=block_n)
    assert layernorm.stability_error(y, x, w, b) < layernorm.STABLE_ATOL
    # The general check allows ill-conditioned rows what rounding their mean costs, no more.
    layernorm.check_layer_norm(y, x, w, b)
    with pytest.raises(checks.MismatchError):
        layernorm.check_layer_norm(layernorm.naive_variance_layer_norm(x, w, b), x, w, b)


def test_fp32_check_stays_tight_on_well_conditioned_rows():
    x = _input((8, 64), torch.float32)
    w, b = _params(64, torch.float32)
    y = layernorm.layer_norm_ref(x, w, b)
    layernorm.check_layer_norm(y, x, w, b)
    with pytest.raises(checks.MismatchError):
        layernorm.check_layer_norm(y + 1e-4, x, w, b)


def test_naive_variance_is_fine_on_ordinary_input():
    x = _input((20, 64), torch.float32)
    w, b = _params(64, torch.float32)
    checks.assert_close(layernorm.naive_variance_layer_norm(x, w, b), layernorm.layer_norm_ref(x, w, b),
                        atol=1e-4, rtol=1e-4)


def test_reference_matches_torch_and_its_gradients_pass_gradcheck():
    x = _input((4, 3, 17), torch.float32)
    w, b = _params(17, torch.float32)
    checks.assert_close(layernorm.layer_norm_ref(x, w, b), F.layer_norm(x, (17,), w, b))
    assert layernorm.layer_norm_ref(x.half(), w.half(), b.half()).dtype == torch.float16
    args = [t.detach().double().cpu().requires_grad_() for t in (x[:2, :2], w, b)]
    assert torch.autograd.gradcheck(layernorm.layer_norm_ref, args)


@pytest.mark.interpret
@pytest.mark.parametrize("shape, block_n", [
    ((1, 1), None), ((3, 10), None), ((37, 300), None), ((5, 7, 100), None),
    ((9, 300), 32), ((4, 257), 16),
    # 70 rows: 9 strips of 8, the last one short, summed over two row blocks of partials.
    ((70, 24), None),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_autograd(shape, block_n, dtype):
    x = _input(shape, dtype, seed=7, requires_grad=True)
    w, b = _params(shape[-1], dtype, seed=7, requires_grad=True)
    dy = checks.randn(shape, dtype=dtype, seed=8, device=DEV)
    grads = torch.autograd.grad(layernorm.layer_norm(x, w, b, block_n=block_n), (x, w, b), dy)
    assert [g.dtype for g in grads] == [dtype] * 3
    layernorm.check_layer_norm_grads(grads, x.detach(), w.detach(), b.detach(), dy, name=f"{shape} {dtype}")


@pytest.mark.interpret
def test_gradient_of_a_sum_arrives_with_zero_strides():
    x = _input((5, 40), torch.float32, requires_grad=True)
    w, b = _params(40, torch.float32, requires_grad=True)
    layernorm.layer_norm(x, w, b).sum().backward()
    layernorm.check_layer_norm_grads((x.grad, w.grad, b.grad), x.detach(), w.detach(), b.detach(),
                                     torch.ones(5, 40, device=DEV))


@pytest.mark.interpret
def test_no_rows():
    x = torch.zeros(0, 3, 16, device=DEV, requires_grad=True)
    w, b = _params(16, torch.float32, requires_grad=True)
    y = layernorm.layer_norm(x, w, b)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros(16, device=DEV))


def _train(norm, steps=3):
    """Linear -> norm -> ReLU -> Linear on a fixed batch; the parameters after ``steps`` SGD steps."""
    params = {
        "w1": checks.randn(12, 40, seed=1, device=DEV, scale=0.3), "b1": torch.zeros(40, device=DEV),
        "g": torch.ones(40, device=DEV), "beta": torch.zeros(40, device=DEV),
        "w2": checks.randn(40, 5, seed=2, device=DEV, scale=0.3), "b2": torch.zeros(5, device=DEV),
    }
    for p in params.values():
        p.requires_grad_()
    opt = torch.optim.SGD(params.values(), lr=0.1)
    x = checks.randn(3, 7, 12, seed=3, device=DEV)
    target = checks.randn(3, 7, 5, seed=4, device=DEV)
    for _ in range(steps):
        hidden = norm(x @ params["w1"] + params["b1"], params["g"], params["beta"])
        loss = F.mse_loss(torch.relu(hidden) @ params["w2"] + params["b2"], target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


@pytest.mark.interpret
def test_three_training_steps_match_torch():
    ours = _train(layernorm.layer_norm)
    theirs = _train(lambda h, g, beta: F.layer_norm(h, (40,), g, beta))
    assert not torch.equal(ours["g"], torch.ones(40, device=DEV)), "the norm's weight never moved"
    for name in ours:
        checks.assert_close(ours[name], theirs[name], name=name)


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((torch.zeros(4, 8), torch.ones(7), torch.zeros(8)), {}, ValueError, "weight has shape"),
    ((torch.zeros(4, 8), torch.ones(8), torch.zeros(1, 8)), {}, ValueError, "bias has shape"),
    ((torch.zeros(4, 8), torch.ones(8).half(), torch.zeros(8)), {}, ValueError, "cast"),
    ((torch.zeros(4, 8, dtype=torch.int32), torch.ones(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)),
     {}, ValueError, "not supported"),
    ((torch.zeros(4, 0), torch.ones(0), torch.zeros(0)), {}, ValueError, "non-empty"),
    ((torch.zeros(4, 8), torch.ones(8), torch.zeros(8)), {"block_n": 48}, ValueError, "power of two"),
    ((torch.zeros(4, 8), torch.ones(8), torch.zeros(8)), {"block_n": 8}, ValueError, "power of two"),
    ((torch.zeros(4, 8), torch.ones(8), torch.zeros(8)), {"kernels": {"bwd": None}}, ValueError, "unknown kernel"),
    ((torch.zeros(4, 8), torch.ones(8), torch.zeros(8)), {"kernels": [None]}, TypeError, "dict"),
    (([1.0], torch.ones(1), torch.zeros(1)), {}, TypeError, "x must be"),
])
def test_validation_messages(args, kwargs, error, message):
    args = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(error, match=message):
        layernorm.layer_norm(*args, **kwargs)


@pytest.mark.skipif(not device.interpreting(), reason="the interpreter's own refusals")
def test_interpreter_refuses_bf16():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        layernorm.layer_norm(x, torch.ones(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.bfloat16))


@triton.jit
def _single_block_skips_last_row(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, stride_xm, stride_ym, N, eps,
                                 BLOCK_N: tl.constexpr):
    # A whole row in one block (right for the default block size), two-pass statistics, and a
    # plausible bug: the last program computes its row but never stores it.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    keep = mask & (row < tl.num_programs(0) - 1)
    tl.store(y_ptr + row * stride_ym + cols, (xc * rstd * w + b).to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _sums_nothing(dw_partial_ptr, db_partial_ptr, dw_ptr, db_ptr, stride_pm, M, N,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pass


@pytest.mark.interpret
@pytest.mark.skipif(device.has_gpu(), reason="outputs are poisoned on the CPU path only")
def test_unwritten_outputs_are_caught_and_kernels_replace_by_name():
    x = _input((6, 50), torch.float32, requires_grad=True)
    w, b = _params(50, torch.float32, requires_grad=True)
    y = layernorm.layer_norm(x, w, b, kernels={"fwd": _single_block_skips_last_row})
    assert y[:5].isfinite().all() and y[5].isnan().all()
    with pytest.raises(checks.MismatchError, match="NaN in actual"):
        layernorm.check_layer_norm(y, x.detach(), w.detach(), b.detach())
    # The replaced forward kernel still feeds the package's backward kernels its statistics.
    dy = checks.randn(6, 50, seed=9)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    checks.assert_close(grads[0][:5], torch.autograd.grad(F.layer_norm(x, (50,), w, b), x, dy)[0][:5])
    y = layernorm.layer_norm(x, w, b, kernels={"bwd_dwdb": _sums_nothing})
    _, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    assert dw.isnan().all() and db.isnan().all()


def test_bytes_model():
    # Forward: x in and y out, plus weight, bias and two fp32 statistics per row.
    assert layernorm.layer_norm_bytes(4, 8, 2) == 2 * 4 * 8 * 2 + 2 * 8 * 2 + 8 * 4
    both = layernorm.layer_norm_bytes(4, 8, 2, backward=True)
    assert both - layernorm.layer_norm_bytes(4, 8, 2) == 3 * 4 * 8 * 2 + 3 * 8 * 2 + 8 * 4


@pytest.mark.parametrize("rows, cols", [(4096, 4096), (64, 768), (100_000, 128), (8, 20_000)])
def test_gpu_configuration_keeps_tiles_bounded(rows, cols):
    # A pure function of the shape, so the GPU choices are checked here too.
    config = layernorm.default_config(cols, rows, capability=90)
    assert config["bwd_block_m"] * config["bwd_block_n"] <= 4096
    assert config["block_n"] <= 8192 and config["block_n"] >= min(cols, 8192)
    # Few rows: strips shrink so that the backward still has programs for every SM.
    if rows <= 64:
        assert config["bwd_block_m"] == 1
    forced = layernorm.default_config(cols, rows, capability=90, block_n=32)
    assert forced["block_n"] == forced["bwd_block_n"] == forced["sum_block_n"] == 32


def test_fp32_checks_allow_for_ill_conditioned_rows_only():
    # Rows with mean 150 and std 0.01 next to ordinary ones: PyTorch's own fp32 LayerNorm is off by
    # ~1e-4 on the former, which the checks must accept, and a 1e-4 error on the latter they must not.
    x = torch.cat([layernorm.catastrophic_input(3, 77, mean=150.0, std=0.01), _input((3, 77), torch.float32).cpu()])
    w, b = (t.cpu() for t in _params(77, torch.float32))
    dy = checks.randn(6, 77, seed=3)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    y = F.layer_norm(leaves[0], (77,), leaves[1], leaves[2])
    layernorm.check_layer_norm(y.detach(), x, w, b)
    layernorm.check_layer_norm_grads(torch.autograd.grad(y, leaves, dy), x, w, b, dy)
    benign = x[3:]
    with pytest.raises(checks.MismatchError):
        layernorm.check_layer_norm(layernorm.layer_norm_ref(benign, w, b) + 1e-4, benign, w, b)
    grads = torch.autograd.grad(F.layer_norm(leaves[0][3:], (77,), leaves[1], leaves[2]), leaves, dy[3:])
    with pytest.raises(checks.MismatchError, match="dx"):
        layernorm.check_layer_norm_grads((grads[0][3:] + 1e-4, grads[1], grads[2]), benign, w, b, dy[3:])
