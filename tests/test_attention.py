"""Lab 05 attention: references, the Triton forward and backward, memory, training, checks."""

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastdl_lab import device  # noqa: F401  (before triton: the interpreter is on without a GPU)

import triton
import triton.language as tl

from fastdl_lab import attention, checks, memory

DEV = "cuda" if device.has_gpu() else "cpu"
DTYPES = [torch.float32, torch.float16]
LAB = Path(__file__).resolve().parent.parent / "labs" / "05_attention.py"

# (batch, heads, tokens, head_dim, block_m, block_n): one token; ragged inside one tile; ragged over
# several tiles of both sizes; an exact multiple of the tiles; the default tiles on a ragged length.
CASES = [
    (1, 1, 1, 32, None, None),
    (1, 2, 37, 64, 32, 32),
    (2, 1, 100, 32, 32, 64),
    (1, 2, 130, 64, 64, 32),
    (2, 2, 64, 32, 32, 32),
    (1, 1, 150, 64, None, None),
]


def _qkv(shape, dtype=torch.float32, seed=0, requires_grad=False, scale=1.0):
    return tuple(checks.randn(shape, dtype=dtype, seed=seed + i, device=DEV, scale=scale).requires_grad_(requires_grad)
                 for i in range(3))


def _label(case):
    return "x".join(str(c) for c in case[:4]) + f"-blocks{case[4]},{case[5]}"


# ------------------------------------------------------------------------------------------------
# References


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, block_m, block_n", [(1, 16, 16), (37, 16, 32), (100, 32, 16), (64, 32, 32)])
def test_tiled_matches_reference(n, block_m, block_n, causal):
    q, k, v = _qkv((2, 3, n, 16), torch.float64)
    out, lse = attention.attention_tiled(q, k, v, causal=causal, block_m=block_m, block_n=block_n, return_lse=True)
    checks.assert_close(out, attention.attention_ref(q, k, v, causal=causal))
    checks.assert_close(lse, attention.logsumexp_ref(q, k, causal=causal))


def test_tiled_handles_more_keys_than_queries_and_low_precision():
    q = checks.randn(1, 2, 20, 32, seed=1)
    k, v = checks.randn(1, 2, 70, 32, seed=2), checks.randn(1, 2, 70, 32, seed=3)
    checks.assert_close(attention.attention_tiled(q, k, v, block_n=32), attention.attention_ref(q, k, v))
    qh, kh, vh = (t[:, :, :20].half() for t in (q, k, v))
    assert attention.attention_tiled(qh, kh, vh).dtype == torch.float16
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention.attention_tiled(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_references_match_torch(causal):
    q, k, v = _qkv((2, 3, 45, 32))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    checks.assert_close(attention.attention_ref(q, k, v, causal=causal), expected)
    checks.assert_close(attention.attention_naive(q, k, v, causal=causal), expected)
    checks.assert_close(attention.attention_ref(q, k, v, scale=0.3),
                        F.scaled_dot_product_attention(q, k, v, scale=0.3))
    assert attention.attention_ref(q.half(), k.half(), v.half()).dtype == torch.float16
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention.attention_ref(q, k[:, :, :10], v[:, :, :10], causal=True)


def test_bytes_and_flops_models():
    n, d = 1024, 64
    # Naive: q, k, v read and o written, plus S written, S read, P written, P read.
    assert attention.attention_bytes(n, d, 2) == (4 * n * d + 4 * n * n) * 2
    # Flash: the same four N x d passes and one fp32 logsumexp a row; nothing N x N.
    assert attention.attention_bytes(n, d, 2, method="flash") == 4 * n * d * 2 + 4 * n
    # Without the cache, each of the 8 query blocks of 128 reads k and v again.
    assert attention.attention_bytes(n, d, 2, method="flash", block_m=128) == (4 + 2 * 7) * n * d * 2 + 4 * n
    assert attention.attention_bytes(n, d, 2, batch_heads=3) == 3 * attention.attention_bytes(n, d, 2)
    with pytest.raises(ValueError, match="method"):
        attention.attention_bytes(n, d, 2, method="tiled")
    assert attention.attention_flops(n, d) == 4 * n * n * d
    assert attention.attention_flops(n, d, causal=True, backward=True, batch_heads=2) == 2 * 3.5 * 2 * n * n * d


# ------------------------------------------------------------------------------------------------
# FlashAttention in PyTorch


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, block_n", [(1, 16), (37, 16), (100, 32), (64, 64), (45, 8)])
def test_torch_flash_matches_sdpa(n, block_n, causal):
    for dtype in (torch.float64, torch.float32):
        q, k, v = _qkv((2, 3, n, 16), dtype, seed=3, requires_grad=True)
        do = checks.randn(2, 3, n, 16, dtype=dtype, seed=6, device=DEV)
        o = attention.flash_attention_torch(q, k, v, causal=causal, block_n=block_n)
        grads = torch.autograd.grad(o, (q, k, v), do)
        assert o.dtype == dtype and [g.dtype for g in grads] == [dtype] * 3
        if dtype == torch.float64:
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            checks.assert_close(o, expected)
            for g, e in zip(grads, torch.autograd.grad(expected, (q, k, v), do)):
                checks.assert_close(g, e)
        else:
            attention.check_attention(o, q.detach(), k.detach(), v.detach(), causal)
            attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal)


def test_torch_flash_takes_one_head_and_cross_attention_and_refuses_the_rest():
    q = checks.randn(2, 20, 16, seed=1, device=DEV)
    k, v = checks.randn(2, 70, 16, seed=2, device=DEV), checks.randn(2, 70, 16, seed=3, device=DEV)
    checks.assert_close(attention.flash_attention_torch(q, k, v, block_n=32), F.scaled_dot_product_attention(q, k, v),
                        atol=1e-5, rtol=1e-4)
    with pytest.raises(attention.UnsupportedAttentionError, match="causal attention"):
        attention.flash_attention_torch(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="block_n"):
        attention.flash_attention_torch(q, k, v, block_n=0)
    with pytest.raises(ValueError, match="floating-point"):
        attention.flash_attention_torch(*(torch.zeros(1, 4, 16, dtype=torch.int64) for _ in range(3)))


def test_torch_flash_keeps_n_by_d_and_creates_nothing_n_by_n():
    b, h, d, block_n = 1, 2, 16, 32
    for n in (128, 256):
        q, k, v = _qkv((b, h, n, d), requires_grad=True)
        _, grads, fig = memory.footprint(
            lambda *t: attention.flash_attention_torch(*t, causal=True, block_n=block_n), q, k, v)
        attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), torch.ones_like(q), True)
        # q, k, v by reference, then o and one logsumexp a row, which are all the forward leaves alive.
        assert fig.saved_bytes == b * h * (3 * n * d + n * d + n) * 4
        assert fig.kept_bytes == b * h * (n * d + n) * 4
        assert fig.largest_elements == b * h * n * block_n  # one tile of scores per (batch, head)
        assert fig.python_bytes < b * h * n * n * 4
        _, _, naive = memory.footprint(lambda *t: attention.attention_ref(*t, causal=True), q, k, v)
        assert naive.saved_bytes >= b * h * n * n * 4 and naive.largest_elements >= b * h * n * n


def _hiding(where: str):
    """Attention that keeps its N x N scores somewhere other than save_for_backward."""
    stash = []

    class Hiding(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            s = q @ k.transpose(-2, -1)
            if where == "ctx":
                ctx.s = s
            elif where == "global":
                stash.append(s)
            else:
                ctx.values = s.flatten().tolist()
            ctx.save_for_backward(q, k, v)
            return torch.softmax(s, -1) @ v

        @staticmethod
        def backward(ctx, do):
            q, k, v = ctx.saved_tensors
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    return Hiding.apply


@pytest.mark.parametrize("where", ["ctx", "global", "python"])
def test_footprint_finds_scores_kept_anywhere(where):
    n = 128
    q, k, v = _qkv((1, 1, n, 16), requires_grad=True)
    fig = memory.footprint(_hiding(where), q, k, v)[2]
    scores = n * n * 4
    assert fig.largest_elements == n * n
    if where == "python":
        # A Python float is 24 bytes and a list slot 8 more: far above the tensor's 4 bytes.
        assert fig.python_bytes >= scores and fig.kept_bytes < scores
    else:
        assert fig.kept_bytes >= scores
        # The saved-tensor count sees a ctx attribute, not a list elsewhere.
        assert (fig.saved_bytes >= scores) == (where == "ctx")


# ------------------------------------------------------------------------------------------------
# Forward


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_forward_matches_reference(case, dtype, causal):
    *shape, block_m, block_n = case
    q, k, v = _qkv(tuple(shape), dtype, seed=10)
    o = attention.flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert o.shape == q.shape and o.dtype == dtype
    attention.check_attention(o, q, k, v, causal, name=f"o {_label(case)} {dtype} causal={causal}")


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_head_dim_128_and_16(dtype):
    for d, causal in ((128, True), (16, False)):
        q, k, v = _qkv((1, 1, 70, d), dtype, seed=11)
        attention.check_attention(attention.flash_attention(q, k, v, causal=causal, block_m=32), q, k, v, causal)


@pytest.mark.interpret
def test_forward_peaked_softmax_and_custom_scale():
    # Large scores: the running maximum must keep every exponential in range.
    q, k, v = _qkv((1, 2, 90, 32), torch.float32, seed=12, scale=6.0)
    attention.check_attention(attention.flash_attention(q, k, v, block_m=32, block_n=32), q, k, v)
    attention.check_attention(attention.flash_attention(q, k, v, causal=True, scale=0.05), q, k, v, True, scale=0.05)
    qh, kh, vh = (t.half() for t in _qkv((1, 2, 90, 32), seed=13, scale=3.0))
    attention.check_attention(attention.flash_attention(qh, kh, vh, causal=True, block_n=32), qh, kh, vh, True)


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [False, True])
def test_forward_saves_only_inputs_output_and_logsumexp(causal):
    q, k, v = _qkv((2, 1, 77, 32), torch.float16, seed=14, requires_grad=True)
    o = attention.flash_attention(q, k, v, causal=causal, block_m=32, block_n=32)
    q3, k3, v3, out, lse = o.grad_fn.saved_tensors
    assert out.data_ptr() == o.data_ptr() and q3.shape == (2, 77, 32)
    assert lse.dtype == torch.float32 and lse.shape == (2, 77)
    expected = attention.logsumexp_ref(q.detach(), k.detach(), causal=causal).reshape(2, 77)
    checks.assert_close(lse, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.interpret
def test_strided_inputs_from_a_fused_projection():
    # (batch, tokens, heads, head_dim) views of one qkv buffer, as a transformer block makes them.
    qkv = checks.randn(2, 50, 3, 2, 32, seed=15, device=DEV)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    attention.check_attention(attention.flash_attention(q, k, v, causal=True, block_m=32), q, k, v, True)


@pytest.mark.interpret
def test_empty_batch_and_sequence():
    for shape in ((0, 2, 16, 32), (1, 2, 0, 32)):
        q, k, v = _qkv(shape, requires_grad=True)
        o = attention.flash_attention(q, k, v)
        assert o.shape == shape
        o.sum().backward()
        assert q.grad.shape == shape


# Aligned lengths take the kernels' unmasked (EVEN_N) code; unequal tiles put two key blocks
# (forward, dQ) or two query blocks (dK/dV) on the diagonal, so that both sides of each split run;
# a ragged length shorter than a tile takes the masked code.
SPLIT_CASES = [(128, 64, 32), (64, 16, 32), (20, 16, 32)]


@pytest.mark.interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_split_loops_forward_and_backward_on_aligned_and_ragged_lengths(causal, dtype):
    for n, block_m, block_n in SPLIT_CASES:
        shape = (1, 1, n, 16)
        q, k, v = _qkv(shape, dtype, seed=80, requires_grad=True)
        do = checks.randn(shape, dtype=dtype, seed=83, device=DEV)
        o = attention.flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
        name = f"N={n} blocks {block_m}x{block_n} {dtype} causal={causal}"
        attention.check_attention(o, q.detach(), k.detach(), v.detach(), causal, name=f"o {name}")
        grads = torch.autograd.grad(o, (q, k, v), do)
        attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal, name=name)


class _Recorder:
    """A kernel stand-in that records the keyword arguments of each launch, then runs ``kernel``."""

    def __init__(self, kernel):
        self.kernel, self.fn, self.launches = kernel, kernel.fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.interpret
def test_launchers_pass_even_n_only_to_kernels_that_declare_it():
    recorders = {key: _Recorder(kernel) for key, kernel in attention.KERNELS.items()}
    for n, expected in ((64, True), (48, False)):
        q, k, v = _qkv((1, 1, n, 16), seed=86, requires_grad=True)
        attention.flash_attention(q, k, v, causal=True, kernels=recorders, block_m=32, block_n=16).sum().backward()
        for key, recorder in recorders.items():
            assert recorder.launches.pop()["EVEN_N"] is expected, key
    # A kernel written to the lab's signature has no EVEN_N: it is launched without one.
    recorder = _Recorder(_one_tile_skips_last_block)
    q, k, v = _qkv((1, 1, 64, 16), seed=87)
    attention.flash_attention(q, k, v, kernels={"fwd": recorder}, block_m=32, block_n=64)
    assert "EVEN_N" not in recorder.launches[0] and recorder.launches[0]["BLOCK_N"] == 64
    with pytest.raises(ValueError, match="optional kernel flags"):
        attention.forward.declared(attention.KERNELS["fwd"], BLOCK_M=16)


# ------------------------------------------------------------------------------------------------
# Backward


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", CASES, ids=_label)
def test_gradients_match_autograd(case, causal):
    *shape, block_m, block_n = case
    q, k, v = _qkv(tuple(shape), seed=20, requires_grad=True)
    do = checks.randn(tuple(shape), seed=23, device=DEV)
    o = attention.flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal,
                                    name=f"{_label(case)} causal={causal}")


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [False, True])
def test_fp16_gradients_follow_the_low_precision_rule(causal):
    shape = (1, 2, 100, 64)
    q, k, v = _qkv(shape, torch.float16, seed=30, requires_grad=True)
    do = checks.randn(shape, dtype=torch.float16, seed=33, device=DEV)
    grads = torch.autograd.grad(attention.flash_attention(q, k, v, causal=causal, block_m=32, block_n=64), (q, k, v), do)
    assert [g.dtype for g in grads] == [torch.float16] * 3
    attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, causal)


@pytest.mark.interpret
@pytest.mark.parametrize("n, spread, scale", [
    (90, 4.0, None),  # peaked rows: scores of tens, where fp32 rounding grows with the scores
    (1, 4.0, 0.5),    # one key: dq and dk are exactly 0, a kernel's are cancellation noise
])
def test_gradients_of_peaked_scores_and_of_one_key(n, spread, scale):
    q, k, v = _qkv((2, 1, n, 32), seed=35, requires_grad=True, scale=spread)
    do = checks.randn(2, 1, n, 32, seed=38, device=DEV)
    o = attention.flash_attention(q, k, v, causal=True, scale=scale, block_m=32, block_n=16)
    attention.check_attention(o, q.detach(), k.detach(), v.detach(), True, scale=scale)
    grads = torch.autograd.grad(o, (q, k, v), do)
    attention.check_attention_grads(grads, q.detach(), k.detach(), v.detach(), do, True, scale=scale)


@pytest.mark.interpret
@pytest.mark.parametrize("causal", [False, True])
def test_backward_parts_judge_each_kernel_on_its_own(causal):
    q, k, v = _qkv((1, 2, 45, 32), seed=24)
    do = checks.randn(1, 2, 45, 32, seed=27, device=DEV)
    core = {key: attention.KERNELS[key] for key in ("bwd_preprocess", "bwd_dkdv")}
    parts = attention.backward_parts(q, k, v, do, core, causal=causal, block_m=16, block_n=32)
    assert set(parts) == {"dk", "dv"}
    attention.check_attention_grads(parts, q, k, v, do, causal)
    parts = attention.backward_parts(q, k, v, do, {"bwd_dq": attention.KERNELS["bwd_dq"]}, causal=causal, block_m=32)
    assert set(parts) == {"dq"}
    attention.check_attention_grads(parts, q, k, v, do, causal)
    with pytest.raises(checks.MismatchError, match="dq"):
        attention.check_attention_grads({"dq": parts["dq"] * 1.01}, q, k, v, do, causal)
    with pytest.raises(ValueError, match="unknown gradient"):
        attention.check_attention_grads({"dx": parts["dq"]}, q, k, v, do, causal)


@pytest.fixture
def truncating_tf32(monkeypatch):
    """A GPU's fp32 tl.dot under the interpreter: tensor cores read each fp32 operand as TF32 by
    dropping its 13 low mantissa bits (on an H200 the kernels below made exactly the errors they
    make here), and the checks take their fp32-on-a-GPU branch."""
    import numpy as np
    from triton.runtime import interpreter

    from fastdl_lab.attention import function

    if not device.interpreting():
        pytest.skip("emulates a GPU's TF32 under the interpreter")
    create_dot = interpreter.InterpreterBuilder.create_dot

    def truncated(h):
        if h.data.dtype != np.float32:
            return h
        return interpreter.TensorHandle((h.data.view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32), h.dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, d, *rest: create_dot(self, truncated(a), truncated(b), d, *rest))
    monkeypatch.setattr(function, "tf32_products", lambda q: q.dtype == torch.float32)


@pytest.mark.interpret
def test_backward_parts_start_from_the_forward_a_gpu_kernel_saves(truncating_tf32):
    q, k, v = _qkv((1, 2, 45, 32), seed=24)
    do = checks.randn(1, 2, 45, 32, seed=27, device=DEV)
    core = {key: attention.KERNELS[key] for key in ("bwd_preprocess", "bwd_dkdv")}
    parts = attention.backward_parts(q, k, v, do, core, causal=True, block_m=16, block_n=32)
    attention.check_attention_grads(parts, q, k, v, do, True)
    # Started from the exact logsumexp instead, the same kernel rebuilds P from truncated scores
    # against an lse they did not produce: dK 0.013 off, 3.3 x the TF32 baseline (as on the H200).
    from fastdl_lab.attention.backward import launch_backward_dkdv
    from fastdl_lab.attention.reference import attention_ref, logsumexp_ref

    config = attention.default_config(32, torch.float32, None, 16, 32)
    q3, k3, v3, do3 = (t.reshape(2, 45, 32).contiguous() for t in (q, k, v, do))
    o3 = attention_ref(q, k, v, causal=True).reshape(2, 45, 32).contiguous()
    lse = logsumexp_ref(q, k, causal=True).reshape(2, 45).contiguous()
    dk, _, _ = launch_backward_dkdv(core, q3, k3, v3, o3, lse, do3, True, 32 ** -0.5, config)
    with pytest.raises(checks.MismatchError, match="dk"):
        attention.check_attention_grads({"dk": dk.view(q.shape)}, q, k, v, do, True)


@triton.jit
def _stub_kernel(x_ptr, N, BLOCK: tl.constexpr):
    raise NotImplementedError()


def test_kernel_written_tells_a_stub_from_a_kernel():
    assert not attention.kernel_written(_stub_kernel)
    assert all(attention.kernel_written(kernel) for kernel in attention.KERNELS.values())
    assert attention.kernel_written(_dq_never_written)


@pytest.mark.interpret
def test_gradient_of_a_sum_arrives_with_zero_strides():
    q, k, v = _qkv((1, 2, 40, 32), seed=40, requires_grad=True)
    attention.flash_attention(q, k, v, causal=True, block_m=16, block_n=16).sum().backward()
    attention.check_attention_grads((q.grad, k.grad, v.grad), q.detach(), k.detach(), v.detach(),
                                    torch.ones(1, 2, 40, 32, device=DEV), True)


def _block(attn, params, x, heads):
    """A pre-norm transformer attention block: LayerNorm, fused qkv projection, attention, projection."""
    b, n, c = x.shape
    h = F.layer_norm(x, (c,))
    q, k, v = (h @ params["w_qkv"]).view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    o = attn(q, k, v).transpose(1, 2).reshape(b, n, c)
    return x + o @ params["w_out"]


def _train(attn, steps=2):
    c = 64
    params = {"w_qkv": checks.randn(c, 3 * c, seed=50, device=DEV, scale=0.2),
              "w_out": checks.randn(c, c, seed=51, device=DEV, scale=0.2)}
    for p in params.values():
        p.requires_grad_()
    opt = torch.optim.SGD(params.values(), lr=0.5)
    x = checks.randn(2, 45, c, seed=52, device=DEV)
    target = checks.randn(2, 45, c, seed=53, device=DEV)
    for _ in range(steps):
        loss = F.mse_loss(_block(attn, params, x, heads=2), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach() for name, p in params.items()}


@pytest.mark.interpret
def test_two_training_steps_of_a_transformer_block_match_the_reference():
    ours = _train(lambda q, k, v: attention.flash_attention(q, k, v, causal=True, block_m=32, block_n=16))
    ref = _train(lambda q, k, v: attention.attention_ref(q, k, v, causal=True))
    start = checks.randn(64, 3 * 64, seed=50, device=DEV, scale=0.2)
    assert not torch.allclose(ours["w_qkv"], start), "the projection never moved"
    # On a GPU fp32 tl.dot runs on TF32 tensor cores: 10-bit mantissas, so TF32's tolerance.
    atol = rtol = 2.0**-10 if DEV == "cuda" else None
    for name in ref:
        checks.assert_close(ours[name], ref[name], atol=atol, rtol=rtol, name=f"{name} after 2 SGD steps")


# ------------------------------------------------------------------------------------------------
# Memory


@pytest.mark.interpret
def test_saved_bytes_linear_for_flash_quadratic_for_naive():
    b, h, d = 1, 2, 32
    for n in (64, 128, 256):
        q, k, v = _qkv((b, h, n, d), requires_grad=True)
        # Flash: q, k, v and o, plus one fp32 logsumexp a row.
        assert memory.saved_tensor_bytes(attention.flash_attention, q, k, v) == b * h * (4 * n * d * 4 + 4 * n)
        # Naive: q, k, v (kept by the matmuls) and the N x N probabilities (kept by softmax and P v).
        assert memory.saved_tensor_bytes(attention.attention_ref, q, k, v) == b * h * (3 * n * d * 4 + 4 * n * n)


@pytest.mark.interpret
def test_nothing_n_by_n_is_saved_for_backward():
    n = 96
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        attention.flash_attention(*_qkv((1, 2, n, 32), torch.float16, requires_grad=True), causal=True)
    assert shapes and all(math.prod(s) < n * n for s in shapes), shapes


# ------------------------------------------------------------------------------------------------
# Kernels by key, poisoned outputs, validation


def test_student_kernel_names_match_the_lab():
    assert set(attention.STUDENT_KERNELS) == set(attention.KERNELS)
    assert set(attention.BWD_KEYS) == set(attention.KERNELS) - {"fwd"}
    source = LAB.read_text()
    for key, name in attention.STUDENT_KERNELS.items():
        match = re.search(rf"^def {name}\((.*?)\):", source, re.M | re.S)
        assert match, f"the lab defines no {name}"
        # Same arguments as the package's kernel, so the launcher can call either; the package's
        # shape specialisations are optional, passed only to a kernel that declares them.
        code = attention.KERNELS[key].fn.__code__
        required = [a for a in code.co_varnames[:code.co_argcount] if a not in attention.OPTIONAL_FLAGS]
        assert [a.split(":")[0].strip() for a in match.group(1).split(",")] == required


@triton.jit
def _one_tile_skips_last_block(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stride_z, stride_row, N, scale,
                               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               HEAD_DIM: tl.constexpr):
    # Right for non-causal attention whose keys fit one tile (plain softmax), with a plausible bug:
    # the last query block is computed but never stored.
    pid_m = tl.program_id(0)
    z = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    kv = z * stride_z + offs_n[:, None] * stride_row + offs_d[None, :]
    k = tl.load(k_ptr + kv, mask=offs_n[:, None] < N, other=0.0)
    v = tl.load(v_ptr + kv, mask=offs_n[:, None] < N, other=0.0)
    s = tl.where(offs_n[None, :] < N, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    total = tl.sum(p, axis=1)
    o = tl.dot(p.to(v.dtype), v) / total[:, None]
    keep = (offs_m < N) & (pid_m < tl.num_programs(0) - 1)
    tl.store(o_ptr + z * stride_z + offs_m[:, None] * stride_row + offs_d[None, :], o, mask=keep[:, None])
    tl.store(lse_ptr + z * N + offs_m, m + tl.log(total), mask=keep)


@triton.jit
def _dq_never_written(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, stride_z, stride_row, N, scale,
                      CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    pass


@pytest.mark.interpret
@pytest.mark.skipif(device.has_gpu(), reason="outputs are poisoned on the CPU path only")
def test_unwritten_outputs_are_caught_and_kernels_replace_by_key():
    q, k, v = _qkv((1, 2, 40, 32), seed=60, requires_grad=True)
    o = attention.flash_attention(q, k, v, kernels={"fwd": _one_tile_skips_last_block}, block_m=16, block_n=64)
    assert o[:, :, :32].isfinite().all() and o[:, :, 32:].isnan().all()
    with pytest.raises(checks.MismatchError, match="NaN in actual"):
        attention.check_attention(o, q.detach(), k.detach(), v.detach())
    do = checks.randn(1, 2, 40, 32, seed=61)
    o = attention.flash_attention(q, k, v, kernels={"bwd_dq": _dq_never_written})
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert dq.isnan().all()
    # The other backward kernels are the package's, fed by the package's forward.
    expected = torch.autograd.grad(attention.attention_ref(q, k, v), (k, v), do)
    checks.assert_close(dk, expected[0], atol=1e-5, rtol=1e-4)
    checks.assert_close(dv, expected[1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (((2, 16), (2, 16), (2, 16)), {}, attention.UnsupportedAttentionError, r"expected \(batch, heads"),
    (((1, 1, 16, 32), (1, 16, 32), (1, 16, 32)), {}, ValueError, "q is 4-D but k is 3-D"),
    (((1, 1, 16, 32), (2, 1, 16, 32), (2, 1, 16, 32)), {}, ValueError, "batch"),
    (((1, 1, 16, 32), (1, 1, 16, 32), (1, 1, 17, 32)), {}, ValueError, "16 keys but v has 17"),
    (((1, 1, 16, 32), (1, 1, 16, 16), (1, 1, 16, 32)), {}, ValueError, "one head_dim"),
    (((1, 1, 16, 32),) * 3, {"block_m": 48}, ValueError, "power of two"),
    (((1, 1, 16, 32),) * 3, {"block_n": 8}, ValueError, "power of two"),
    (((1, 1, 16, 32),) * 3, {"kernels": {"bwd": None}}, ValueError, "unknown kernel"),
    (((1, 1, 16, 32),) * 3, {"kernels": [None]}, TypeError, "dict"),
    (((1, 1, 16, 32),) * 3, {"scale": -1.0}, ValueError, "scale"),
    (((1, 1, 16, 32),) * 3, {"causal": "yes"}, TypeError, "causal"),
])
def test_validation_messages(args, kwargs, error, message):
    tensors = [torch.zeros(shape, device=DEV) for shape in args]
    with pytest.raises(error, match=message):
        attention.flash_attention(*tensors, **kwargs)


# What the kernels do not compute is refused by name, with the way round it, before any reshape.
@pytest.mark.parametrize("shapes, kwargs, message", [
    (((1, 1, 16, 32), (1, 1, 17, 32), (1, 1, 17, 32)), {}, "16 queries but 17 keys: these kernels compute self"),
    (((1, 16, 32), (1, 20, 32), (1, 20, 32)), {"is_causal": True}, "causal attention lets query i see"),
    (((1, 1, 16, 48),) * 3, {}, "head_dim 48 is not supported"),
    (((1, 2, 16, 256),) * 3, {}, "head_dim 256 is not supported"),
    (((1, 1, 16, 32), (1, 1, 16, 32), (1, 1, 16, 64)), {}, "v has head_dim 64"),
    (((1, 4, 16, 32), (1, 2, 16, 32), (1, 2, 16, 32)), {}, "grouped-query attention is not supported"),
    (((1, 1, 16, 32),) * 3, {"attn_mask": torch.ones(16, 16, dtype=torch.bool)}, "attn_mask is not supported"),
    (((1, 1, 16, 32),) * 3, {"dropout_p": 0.1}, "dropout_p=0.1 is not supported"),
])
def test_unsupported_inputs_raise_a_named_error(shapes, kwargs, message):
    tensors = [torch.zeros(shape, device=DEV) for shape in shapes]
    with pytest.raises(attention.UnsupportedAttentionError, match=message):
        attention.flash_attention(*tensors, **kwargs)
    if not {"attn_mask", "dropout_p"} & set(kwargs):
        with pytest.raises(attention.UnsupportedAttentionError, match=message):
            attention.FlashAttentionFunction.apply(*tensors, kwargs.get("is_causal", False))
    assert issubclass(attention.UnsupportedAttentionError, ValueError)


def test_causal_and_is_causal_must_agree():
    x = torch.zeros(1, 1, 16, 32, device=DEV)
    with pytest.raises(ValueError, match="disagree"):
        attention.flash_attention(x, x, x, causal=True, is_causal=False)
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        attention.flash_attention(x, x, x, is_causal="yes")


@pytest.mark.interpret
def _function_apply_takes_keywords() -> bool:
    """torch 2.11's Function.apply takes positional arguments only; 2.13's takes keywords too."""
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, flag=False):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    try:
        Identity.apply(torch.zeros(1), flag=True)
    except TypeError:
        return False
    return True


def test_called_like_scaled_dot_product_attention():
    # (batch, tokens, head_dim) as one head, is_causal as a keyword, and the autograd.Function
    # applied directly with its defaults: all as F.scaled_dot_product_attention would be called.
    q, k, v = _qkv((2, 45, 32), seed=16, requires_grad=True)
    do = checks.randn(2, 45, 32, seed=19, device=DEV)
    calls = [lambda: attention.flash_attention(q, k, v, is_causal=True, block_m=16, block_n=32),
             lambda: attention.FlashAttentionFunction.apply(q, k, v, True)]
    if _function_apply_takes_keywords():
        calls.append(lambda: attention.FlashAttentionFunction.apply(q, k, v, is_causal=True))
    for o in (call() for call in calls):
        assert o.shape == (2, 45, 32)
        # To the inputs' precision: fp32 tl.dot runs on TF32 tensor cores on a GPU.
        attention.check_attention(o[:, None], q.detach()[:, None], k.detach()[:, None], v.detach()[:, None], True)
        grads = torch.autograd.grad(o, (q, k, v), do)
        assert [g.shape for g in grads] == [(2, 45, 32)] * 3
        attention.check_attention_grads([g[:, None] for g in grads], q.detach()[:, None], k.detach()[:, None],
                                        v.detach()[:, None], do[:, None], True)
    q4, k4, v4 = (t.detach()[:, None].expand(2, 3, 45, 32) for t in (q, k, v))
    attention.check_attention(attention.FlashAttentionFunction.apply(q4, k4, v4, False, 0.3), q4, k4, v4, False,
                              scale=0.3)


def test_validation_of_types_and_dtypes():
    x = torch.zeros(1, 1, 16, 32, device=DEV)
    with pytest.raises(TypeError, match="causal"):
        attention.flash_attention(x, x, x, causal=2.5)
    with pytest.raises(TypeError, match="q must be"):
        attention.flash_attention([1.0], x, x)
    with pytest.raises(ValueError, match="cast"):
        attention.flash_attention(x, x.half(), x)
    with pytest.raises(ValueError, match="not supported"):
        attention.flash_attention(x.double(), x.double(), x.double())


@pytest.mark.skipif(not device.interpreting(), reason="the interpreter's own refusals")
def test_interpreter_refuses_bf16():
    # The interpreter multiplies bf16 bit patterns in tl.dot: a bf16 run would be silently wrong.
    x = torch.zeros(1, 1, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        attention.flash_attention(x, x, x)


# ------------------------------------------------------------------------------------------------
# The check rules


def test_checks_reject_what_they_should():
    q, k, v = _qkv((1, 2, 30, 32), seed=70)
    exact = attention.attention_ref(q, k, v, causal=True)
    attention.check_attention(exact, q, k, v, True)
    # Beyond fp32 rounding on the CPU; on a GPU the fp32 baseline is TF32, whose rounding is ~1e-3.
    off = 1e-4 if DEV == "cpu" else 3e-2
    with pytest.raises(checks.MismatchError):
        attention.check_attention(exact + off, q, k, v, True)
    # Forgetting the mask is a large error, not a rounding one, in any precision.
    with pytest.raises(checks.MismatchError):
        attention.check_attention(attention.attention_ref(q, k, v), q, k, v, True)
    qh, kh, vh = (t.half() for t in (q, k, v))
    with pytest.raises(checks.MismatchError):
        attention.check_attention(attention.attention_ref(qh, kh, vh), qh, kh, vh, True)
    # Half a percent off the gradient in one element is far beyond fp32 rounding.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    do = checks.randn(1, 2, 30, 32, seed=71, device=DEV)
    grads = list(torch.autograd.grad(attention.attention_ref(*leaves, causal=True), leaves, do))
    attention.check_attention_grads(grads, q, k, v, do, True)
    grads[1] = grads[1].clone()
    grads[1][0, 1, 5, 3] *= 1.005 if DEV == "cpu" else 1.2
    with pytest.raises(checks.MismatchError, match="dk"):
        attention.check_attention_grads(grads, q, k, v, do, True)


def test_low_precision_grads_accept_fp32_accurate_results():
    # One key: PyTorch's fp16 dq is exactly 0 while a kernel's is rounding noise of order 1e-7.
    q, k, v = _qkv((1, 1, 1, 32), torch.float16, seed=72)
    do = checks.randn(1, 1, 1, 32, dtype=torch.float16, seed=73, device=DEV)
    noise = torch.full((1, 1, 1, 32), 3e-7, device=DEV).half()
    attention.check_attention_grads((noise, noise, do.clone()), q, k, v, do)
    with pytest.raises(checks.MismatchError, match="dv"):
        attention.check_attention_grads((noise, noise, do * 1.01), q, k, v, do)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_gpu_configuration(head_dim):
    # A pure function of the shape and the GPU, so the GPU choices are checked here too.
    for capability in (80, 90):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            config = attention.default_config(head_dim, dtype, capability)
            for key in ("block_m", "block_n", "bwd_block_m", "bwd_block_n"):
                assert config[key] >= 16 and config[key] & (config[key] - 1) == 0
            # fp32 tiles are half as tall: same bytes in shared memory as the 16-bit ones.
            assert config["block_m"] * dtype.itemsize <= 256
            assert config["num_stages"] >= 2 and config["bwd_num_stages"] >= 2
    # Hopper's larger shared memory takes a deeper forward pipeline than Ampere's.
    assert attention.default_config(head_dim, torch.float16, 90)["num_stages"] == 3
    assert attention.default_config(head_dim, torch.float16, 80)["num_stages"] == 2
    forced = attention.default_config(64, torch.float16, 90, block_m=32, block_n=16)
    assert (forced["block_m"], forced["block_n"], forced["bwd_block_m"], forced["bwd_block_n"]) == (32, 16, 32, 16)
    assert attention.default_config(64, torch.float32, None)["num_stages"] == 1
