"""The checked interpreter (fastdl_lab.bounds): a kernel with a mask removed raises a named
exception instead of corrupting memory or killing the process, and correct kernels are unchanged.

The kernels run in a child process: should the check miss, the wild access crashes the child and
fails the test, not pytest.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.interpret

SCRIPT = textwrap.dedent('''
    import json
    from fastdl_lab import device  # turns the interpreter and its checks on
    import torch, triton, triton.language as tl
    from fastdl_lab import bounds, softmax

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    @triton.jit
    def add_store_unmasked(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask))

    @triton.jit
    def softmax_load_unmasked(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * stride_x + cols)
        x = x - tl.max(x, axis=0)
        tl.store(y_ptr + row * stride_y + cols, tl.exp(x) / tl.sum(tl.exp(x), axis=0), mask=cols < n_cols)

    @triton.jit
    def store_far_away(out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + (1 << 40) + offs, tl.zeros((BLOCK,), dtype=tl.float32))

    def attempt(fn):
        try:
            fn()
        except bounds.OutOfBoundsAccess as exc:
            return str(exc)
        return None

    out = {}
    x, y = torch.randn(1000), torch.randn(1000)
    z = torch.full((1000,), -1.0)
    add_kernel[(4,)](x, y, z, 1000, BLOCK=256)
    out["add_ok"] = torch.equal(z, x + y)
    inplace = x.clone()
    add_kernel[(4,)](inplace, y, inplace, 1000, BLOCK=256)  # aliased arguments share one padded copy
    out["inplace_ok"] = torch.equal(inplace, x + y)
    before = z.clone()
    out["add_oob"] = attempt(lambda: add_store_unmasked[(4,)](x, y, z, 1000, BLOCK=256))
    out["wild"] = attempt(lambda: store_far_away[(1,)](z, BLOCK=16))
    out["nothing_written"] = torch.equal(z, before)
    a = torch.randn(37, 100)
    out["softmax_ok"] = torch.allclose(softmax.softmax(a), torch.softmax(a, dim=1), atol=1e-6)
    out["softmax_oob"] = attempt(lambda: softmax.softmax(a, kernel=softmax_load_unmasked))
    # fused AdamW reaches its tensors through address tables, not arguments
    from fastdl_lab import optim

    @triton.jit
    def adam_store_unmasked(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, master_addrs, numels,
                            chunk_tensor, chunk_start, step, lr, beta1, beta2, eps, weight_decay,
                            PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(chunk_tensor + pid)
        offs = tl.load(chunk_start + pid) + tl.arange(0, BLOCK)
        m_ptr = tl.load(exp_avg_addrs + t).to(tl.pointer_type(tl.float32))
        tl.store(m_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32))

    shapes = [(300,), (7, 9)]
    params = [torch.randn(s) for s in shapes]
    reference = [p.clone().requires_grad_() for p in params]
    grads = [torch.randn(s) for s in shapes]
    state = [[torch.zeros(s) for s in shapes] for _ in range(2)]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
    optim.fused_adamw(params, grads, *state, 1, block=128, **hp)
    for r, g in zip(reference, grads):
        r.grad = g
    torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05).step()
    out["adamw_ok"] = all(torch.allclose(p, r, atol=1e-6) for p, r in zip(params, reference))
    out["adamw_oob"] = attempt(lambda: optim.fused_adamw(params, grads, *state, 2, block=128, kernel=adam_store_unmasked, **hp))
    with bounds.unchecked():
        # unchecked, an unmasked load past the end reads what lies there: no exception
        out["unchecked"] = attempt(lambda: softmax.softmax(a.clone(), kernel=softmax_load_unmasked))
    print(json.dumps(out))
''')


def test_unmasked_accesses_raise_named_errors_and_correct_kernels_pass():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1", "FASTDL_CHECK_BOUNDS": "1"})
    assert done.returncode == 0, f"the child died (rc {done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["add_ok"] and out["inplace_ok"] and out["softmax_ok"]
    assert out["add_oob"] == ("out-of-bounds store in kernel 'add_store_unmasked' (program (3, 0, 0)): 'out_ptr' "
                              "at element 1000, outside its elements 0..999 (float32); 24 of 256 unmasked lanes "
                              "out: is a mask missing?")
    assert out["nothing_written"]
    assert out["wild"].startswith("out-of-bounds store in kernel 'store_far_away' (program (0, 0, 0)): address 0x")
    assert "far outside every tensor of the launch (the nearest, 'out_ptr', is " in out["wild"]
    assert out["softmax_oob"].startswith("out-of-bounds load in kernel 'softmax_load_unmasked' (program (36, 0, 0)): "
                                         "'x_ptr' at element 3700, outside its elements 0..3699")
    assert out["unchecked"] is None
    assert out["adamw_ok"]
    assert out["adamw_oob"].startswith("out-of-bounds store in kernel 'adam_store_unmasked' (program (2, 0, 0)): "
                                       "'list 2 tensor 0' at element 300, outside its elements 0..299"), out["adamw_oob"]
