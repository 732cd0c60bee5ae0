import math

import pytest
import torch

from fastdl_lab import checks
from fastdl_lab.checks import MismatchError


def test_tolerances():
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        atol, rtol = checks.tolerance(dtype)
        assert 0 < atol < 0.1 and 0 < rtol < 0.1
        # Each tolerance is at least the dtype's own rounding unit, or every kernel would fail.
        assert rtol >= torch.finfo(dtype).eps / 2
    assert checks.tolerance(torch.int32) == (0.0, 0.0)
    with pytest.raises(ValueError):
        checks.tolerance(torch.float8_e4m3fn)


def test_assert_close_passes_within_tolerance():
    expected = checks.randn(50, 30)
    checks.assert_close(expected * (1 + 5e-6), expected)
    checks.assert_close(expected.half() + 1e-4, expected.half())
    checks.assert_close(torch.arange(6), torch.arange(6))


def test_assert_close_reports_the_worst_element():
    expected = checks.randn(4, 5)
    actual = expected.clone()
    actual[2, 3] += 0.5
    actual[0, 1] += 0.01
    with pytest.raises(MismatchError) as err:
        checks.assert_close(actual, expected, name="y")
    report = err.value.report
    assert report == str(err.value)
    assert report.startswith("y: 2 of 20 elements (10.00%) differ")
    assert "max abs error 0.5 at (2, 3)" in report
    worst = report.splitlines()[report.splitlines().index(
        next(line for line in report.splitlines() if "worst 2" in line)) + 1]
    assert worst.strip().startswith("(2, 3):")
    assert f"{float(expected[2, 3]):.6g}" in worst


def test_nan_is_a_mismatch_and_its_position_is_reported():
    expected = torch.zeros(3, 4)
    actual = expected.clone()
    actual[1, 2] = math.nan
    with pytest.raises(MismatchError) as err:
        checks.assert_close(actual, expected)
    assert "NaN in actual: 1 at (1, 2)" in err.value.report
    assert "(1, 2): nan vs 0" in err.value.report


def test_nan_against_nan_needs_equal_nan():
    expected = torch.tensor([1.0, math.nan, math.inf])
    actual = expected.clone()
    with pytest.raises(MismatchError) as err:
        checks.assert_close(actual, expected)
    assert "NaN in expected: 1 at (1,)" in err.value.report
    checks.assert_close(actual, expected, equal_nan=True)


def test_infinities_must_match_in_sign():
    expected = torch.tensor([math.inf, 1.0])
    checks.assert_close(expected.clone(), expected)
    with pytest.raises(MismatchError) as err:
        checks.assert_close(torch.tensor([-math.inf, 1.0]), expected)
    assert "Inf in actual: 1 at (0,)" in err.value.report


def test_explicit_and_dtype_tolerances():
    expected = torch.ones(10)
    actual = expected + 1e-3
    with pytest.raises(MismatchError):
        checks.assert_close(actual, expected)
    checks.assert_close(actual, expected, atol=2e-3)
    checks.assert_close(actual, expected, dtype=torch.float16)


@pytest.mark.parametrize("actual, message", [
    ([1.0, 2.0], "expected a torch.Tensor, got list"),
    (torch.zeros(3, 2), "shape (3, 2), expected (2, 3)"),
    (torch.zeros(2, 3, dtype=torch.float64), "dtype torch.float64, expected torch.float32"),
])
def test_type_shape_and_dtype_messages(actual, message):
    with pytest.raises(MismatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checks.assert_close(actual, torch.zeros(2, 3))


def test_tensor_subclasses_are_rejected():
    class Lazy(torch.Tensor):
        pass

    expected = torch.zeros(3)
    with pytest.raises(MismatchError, match="subclass Lazy"):
        checks.assert_close(expected.clone().as_subclass(Lazy), expected)


def _fp16_matmul_case(seed):
    a = checks.randn(64, 96, seed=seed)
    b = checks.randn(96, 48, seed=seed + 1)
    reference = a.double() @ b.double()
    lowp = a.half() @ b.half()
    return a, b, reference.float(), lowp


def test_low_precision_rule_accepts_torchs_own_result():
    _, _, reference, lowp = _fp16_matmul_case(0)
    checks.assert_low_precision_close(lowp.clone(), reference, lowp)
    # A result computed in fp32 and rounded once is at least as good as torch's.
    checks.assert_low_precision_close(reference.half(), reference, lowp)


def test_low_precision_rule_rejects_a_truncated_result():
    _, _, reference, lowp = _fp16_matmul_case(0)
    # Chop fp16's 10 mantissa bits to 4, as a kernel accumulating in too few bits might.
    truncated = (lowp.view(torch.int16) & ~0x3F).view(torch.float16)
    with pytest.raises(MismatchError) as err:
        checks.assert_low_precision_close(truncated, reference, lowp, name="c")
    assert err.value.report.startswith("c: max abs error")
    assert "worst" in err.value.report


def test_low_precision_rule_rejects_nan_and_wrong_dtype():
    _, _, reference, lowp = _fp16_matmul_case(1)
    poisoned = lowp.clone()
    poisoned[3, 4] = math.nan
    with pytest.raises(MismatchError, match="NaN in actual"):
        checks.assert_low_precision_close(poisoned, reference, lowp)
    with pytest.raises(MismatchError, match="dtype torch.float32"):
        checks.assert_low_precision_close(reference, reference, lowp)


def test_low_precision_rule_has_a_floor_for_exact_torch_results():
    reference = torch.tensor([1.0, 2.0, 4.0])
    exact = reference.half()
    checks.assert_low_precision_close(exact.clone(), reference, exact)
    with pytest.raises(MismatchError):
        checks.assert_low_precision_close(exact + 2**-9, reference, exact)


def test_seeded_inputs():
    a = checks.randn(3, 5, seed=7)
    assert torch.equal(a, checks.randn((3, 5), seed=7))
    assert not torch.equal(a, checks.randn(3, 5, seed=8))
    half = checks.randn(3, 5, seed=7, dtype=torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, a.half())
    shifted = checks.randn(3, 5, seed=7, scale=2.0, offset=1.0)
    assert torch.allclose(shifted, a * 2 + 1)
    g1, g2 = checks.generator(5), checks.generator(5)
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


def test_fresh_seeds_differ_and_fit_int64():
    seeds = {checks.fresh_seed() for _ in range(8)}
    assert len(seeds) == 8
    assert all(0 <= s < 2**63 for s in seeds)
    checks.randn(2, seed=seeds.pop())


def test_poisoned_outputs():
    t = checks.poisoned_empty((3, 4), torch.float16)
    assert t.shape == (3, 4) and t.dtype == torch.float16 and t.isnan().all()
    like = checks.poisoned_like(torch.zeros(5, 2).t())
    assert like.shape == (2, 5) and like.stride() == (1, 2) and like.isnan().all()
    ints = checks.poisoned_like(torch.zeros(4, dtype=torch.int32))
    assert (ints == torch.iinfo(torch.int32).min).all()


def test_a_forgotten_element_of_a_poisoned_output_fails_the_check():
    expected = checks.randn(8)
    out = checks.poisoned_like(expected)
    out[:7] = expected[:7]
    with pytest.raises(MismatchError, match=r"NaN in actual: 1 at \(7,\)"):
        checks.assert_close(out, expected)


def test_shares_memory():
    x = torch.zeros(6, 8)
    assert checks.shares_memory(x, x)
    assert checks.shares_memory(x, x.view(48))
    assert checks.shares_memory(x, x.t())
    assert checks.shares_memory(x, x[2:4, 3])
    assert checks.shares_memory(x[:3], x[2:])
    assert not checks.shares_memory(x[:3], x[3:])
    # Interleaved columns span the same bytes yet never share one.
    assert not checks.shares_memory(x[:, 0], x[:, 1])
    assert checks.shares_memory(x[:, 1], x[2])
    assert not checks.shares_memory(x[::2], x[1::2])
    assert checks.shares_memory(x.view(torch.int16)[:, 1], x[:, 0])
    assert not checks.shares_memory(x.view(torch.int16)[:, 2], x[:, 0])
    assert checks.shares_memory(x[0, 0].expand(4), x[:, 0])
    assert not checks.shares_memory(x, x.clone())
    assert not checks.shares_memory(x, torch.zeros(6, 8))
    assert not checks.shares_memory(x[:0], x)


def test_assert_no_alias():
    a, b = torch.zeros(4), torch.ones(4)
    checks.assert_no_alias(a + b, [a, b])
    with pytest.raises(AssertionError, match="out aliases input #1"):
        checks.assert_no_alias(b[1:], [a, b, 3], name="out")


def test_output_buffer_is_poisoned_on_the_cpu():
    like = torch.zeros(3)
    out = checks.output_buffer((2, 5), torch.float16, like)
    assert out.shape == (2, 5) and out.dtype == torch.float16 and bool(out.isnan().all())


def test_tf32_truncation_keeps_ten_mantissa_bits():
    x = checks.randn(1000, seed=3)
    t = checks.truncate_to_tf32(x)
    assert (t.view(torch.int32) & 0x1FFF).eq(0).all()
    rel = ((x - t).abs() / x.abs()).max()
    assert 0 < rel < 2.0 ** -10


def test_tf32_matmul_error_sits_between_fp32_and_bf16():
    a, b = checks.randn(64, 200, seed=4), checks.randn(200, 48, seed=5)
    exact = a.double() @ b.double()
    err = lambda c: float((c.double() - exact).abs().max())  # noqa: E731
    fp32, tf32 = err(a @ b), err(checks.tf32_matmul(a, b))
    bf16 = err((a.bfloat16() @ b.bfloat16()).float())
    assert fp32 < tf32 < bf16
