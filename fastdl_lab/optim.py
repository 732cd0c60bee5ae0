"""AdamW three ways, and the multi-tensor apply behind fused optimizers (lab 04 mixed precision).

An optimizer step does a dozen FLOPs per element of every parameter: it is bound by memory traffic
and, for a model of many small tensors, by the number of kernel launches.

- ``adamw_ref``: torch.optim.AdamW's single-tensor math, one tensor after another;
- ``adamw_foreach``: the same in ``torch._foreach_*`` ops, a few multi-tensor ops per dtype group;
- ``_fused_adamw_kernel`` + ``fused_adamw``: every tensor of a dtype group in ONE Triton launch,
  whatever their number: their addresses travel in int64 tables in device memory, with a chunk
  table saying which tensor and elements each program owns (``multi_tensor_table``);
- ``AdamW``: a ``torch.optim.Optimizer`` on any of the three, with optional fp32 master weights,
  in which updates too small for a bf16 or fp16 parameter accumulate instead of vanishing;
- ``compiled_step_graphs``: torch's own AdamW step under ``torch.compile``, and what a learning-rate
  schedule does to its graphs.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU
from fastdl_lab import bounds, checks, timing, triton_aot

import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _prepare(params, grads, exp_avgs, exp_avg_sqs, masters, step, beta1, beta2):
    """Masters as a list (None where a param has none), and the two bias corrections (as torch's)."""
    if any(len(lst) != len(params) for lst in (grads, exp_avgs, exp_avg_sqs, params if masters is None else masters)):
        raise ValueError("params, grads, exp_avgs, exp_avg_sqs (and masters) must have one entry per parameter")
    if step < 1:
        raise ValueError(f"step counts from 1 (the count after this update), got {step}")
    return [None] * len(params) if masters is None else list(masters), 1 - beta1**step, (1 - beta2**step) ** 0.5


def _group(rows, key) -> dict:
    """Rows of (param, grad, exp_avg, exp_avg_sq, master), transposed into five lists per ``key(row)``."""
    groups = defaultdict(lambda: ([], [], [], [], []))
    for row in rows:
        for lst, t in zip(groups[key(row)], row):
            lst.append(t)
    return groups


def adamw_ref(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps, weight_decay, masters=None):
    """AdamW on one tensor at a time, in torch.optim.AdamW(foreach=False)'s order of operations."""
    masters, bc1, bc2_sqrt = _prepare(params, grads, exp_avgs, exp_avg_sqs, masters, step, beta1, beta2)
    for param, grad, m, v, master in zip(params, grads, exp_avgs, exp_avg_sqs, masters):
        # A 16-bit parameter without a master is updated in an fp32 copy and rounded once at the end.
        w = master if master is not None else param if param.dtype == torch.float32 else param.float()
        g = grad.float()
        if weight_decay != 0:
            w.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bc2_sqrt).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bc1)
        if w is not param:
            param.copy_(w)


def adamw_foreach(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps, weight_decay, masters=None):
    """AdamW with multi-tensor ``torch._foreach_*`` ops, one series per (device, dtype, master) group."""
    masters, bc1, bc2_sqrt = _prepare(params, grads, exp_avgs, exp_avg_sqs, masters, step, beta1, beta2)
    rows = zip(params, grads, exp_avgs, exp_avg_sqs, masters)
    for (_, dtype, has_master), (ps, gs, ms, vs, ws) in _group(rows, lambda r: (r[0].device, r[0].dtype,
                                                                                r[4] is not None)).items():
        # There is no foreach cast: 16-bit tensors are widened one by one.
        if not has_master:
            ws = ps if dtype == torch.float32 else [p.float() for p in ps]
        if dtype != torch.float32:
            gs = [g.float() for g in gs]
        if weight_decay != 0:
            torch._foreach_mul_(ws, 1 - lr * weight_decay)
        torch._foreach_lerp_(ms, gs, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - beta2)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(ws, ms, denom, value=-lr / bc1)
        if ws is not ps:
            torch._foreach_copy_(ps, ws)


@triton.jit
def _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, step, lr, beta1, beta2, eps, weight_decay,
                 PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """AdamW on elements ``offs`` of one tensor: those where ``mask`` holds, or all of them (None).
    Lanes outside the mask are loaded as anything and never stored: they need no fill value."""
    ### BEGIN SOLUTION
    if HAS_MASTER:
        w = tl.load(w_ptr + offs, mask=mask)
    else:
        w = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)

    # Every program recomputes beta**step from the step count: two scalar ops beat a host round trip.
    bc1 = 1 - tl.exp2(step * tl.log2(beta1))
    bc2 = 1 - tl.exp2(step * tl.log2(beta2))
    w = w * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    denom = tl.sqrt(v) / tl.sqrt(bc2) + eps
    w = w - (lr / bc1) * (m / denom)

    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(PARAM_DTYPE), mask=mask)
    ### END SOLUTION


@triton.jit
def _fused_adamw_kernel(param_addrs, grad_addrs, exp_avg_addrs, exp_avg_sq_addrs, master_addrs, numels,
                        chunk_tensor, chunk_start, step, lr, beta1, beta2, eps, weight_decay,
                        PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr,
                        ALIGNED: tl.constexpr = False):
    """One program updates BLOCK elements (from ``chunk_start[pid]``) of tensor ``chunk_tensor[pid]``.
    ``ALIGNED``: the launcher found every address in the tables a multiple of 16 bytes. Without it
    the arguments are lab 04's."""
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    n = tl.load(numels + t)
    # The tables hold raw addresses: the cast gives them back their element type.
    p_ptr = tl.load(param_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    g_ptr = tl.load(grad_addrs + t).to(tl.pointer_type(PARAM_DTYPE))
    m_ptr = tl.load(exp_avg_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_addrs + t).to(tl.pointer_type(tl.float32))
    w_ptr = tl.load(master_addrs + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        # Addresses read from memory carry no alignment the compiler can see: without these hints
        # every access is a 4-byte scalar one; with them, whole chunks move as 16-byte vectors.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        start = tl.multiple_of(start, BLOCK)
    offs = start + tl.arange(0, BLOCK)
    # Every chunk but a tensor's last is whole: no mask there, which a vector access needs.
    if start + BLOCK <= n:
        _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, None, step, lr, beta1, beta2, eps, weight_decay,
                     PARAM_DTYPE, HAS_MASTER)
    else:
        _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, step, lr, beta1, beta2, eps,
                     weight_decay, PARAM_DTYPE, HAS_MASTER)
    ### END SOLUTION


class MultiTensorTable(NamedTuple):
    """Device tables of one launch: ``addrs[k][t]`` is the address of tensor t of list k; ``aligned``:
    every one of them is a multiple of 16 bytes (PyTorch's allocations are; a view may not be)."""
    addrs: list[torch.Tensor]
    numels: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_start: torch.Tensor
    n_chunks: int
    aligned: bool


# The tables of recent launches, by what they hold. A table is a pure function of (device, block,
# addresses, lengths), so a hit is exact, and a training loop passes the same tensors every step:
# without the cache a step of a large model spends more time building tables than updating it.
_TABLES: dict[tuple, MultiTensorTable] = {}
_TABLES_KEPT = 8


def multi_tensor_table(tensor_lists: Sequence[Sequence[torch.Tensor]], block: int) -> MultiTensorTable:
    """Address, length and chunk tables (int64, on the tensors' device) for lists of equal-length tensors.

    The torch ops it costs do not grow with the number of tensors or chunks: everything travels as
    one buffer (from pinned memory, without a host sync, on a GPU). A table built for the same
    addresses before is reused, at no torch op at all.
    """
    first = tensor_lists[0]
    numels = [t.numel() for t in first]
    ptrs = [t.data_ptr() for lst in tensor_lists for t in lst]
    dev = first[0].device if first else torch.device("cpu")
    key = (dev, block, tuple(ptrs), tuple(numels))
    table = _TABLES.get(key)
    if table is None:
        table = _build_table(ptrs, numels, len(tensor_lists), block, dev)
        if len(_TABLES) >= _TABLES_KEPT:
            del _TABLES[next(iter(_TABLES))]
        _TABLES[key] = table
    # Under the checked interpreter a launch given this table may touch the tensors it points at.
    bounds.declare_table([*table.addrs, table.numels],
                         [(f"list {k} tensor {i}", t) for k, lst in enumerate(tensor_lists) for i, t in enumerate(lst)])
    return table


def _build_table(ptrs: list[int], numels: list[int], n_lists: int, block: int, dev: torch.device) -> MultiTensorTable:
    # NumPy expands the chunk tables, so that a build dispatches the same few torch ops however many
    # tensors and chunks there are (lab 04's grader counts them): the buffer taken as a tensor and
    # split; on a GPU also pinned (two ops: is_pinned, _pin_memory) and copied to the device.
    counts = -(-np.asarray(numels, dtype=np.int64) // block)
    n, n_chunks = len(numels), int(counts.sum())
    chunk_tensor = np.repeat(np.arange(n, dtype=np.int64), counts)
    first_chunk = np.cumsum(counts) - counts
    chunk_start = (np.arange(n_chunks, dtype=np.int64) - first_chunk[chunk_tensor]) * block
    host = torch.from_numpy(np.concatenate([np.asarray(ptrs + numels, dtype=np.int64), chunk_tensor, chunk_start]))
    if dev.type == "cuda":
        host = host.pin_memory()  # a copy from pinned memory needs no host sync
    parts = host.to(dev, non_blocking=True).split([n] * (n_lists + 1) + [n_chunks] * 2)
    return MultiTensorTable(list(parts[:n_lists]), *parts[n_lists:], n_chunks, all(p % 16 == 0 for p in ptrs))


def _validate_fused(params, grads, exp_avgs, exp_avg_sqs, masters) -> None:
    # Not device.check_kernel_tensor: its bf16 refusal is about tl.dot, which this kernel never
    # calls (bf16 loads and stores work under the interpreter), and it lets a 'meta' tensor through.
    where = "cpu" if device.interpreting() else "cuda"
    for i, (p, g, m, v, w) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, masters)):
        named = {"param": p, "grad": g, "exp_avg": m, "exp_avg_sq": v, "master": w}
        for name, t in ((name, t) for name, t in named.items() if t is not None or name != "master"):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} {i} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != (torch.float32 if name not in ("param", "grad") else p.dtype):
                raise TypeError(f"{name} {i} is {t.dtype}; grads have their param's dtype, state is float32")
            if t.device != params[0].device or t.device.type != where:
                raise ValueError(f"{name} {i} is on {t.device}; all must be on one {where!r} device here")
            if not t.is_contiguous() or t.numel() != p.numel():
                raise ValueError(f"{name} {i} must be contiguous (the kernel walks it as one flat run) and "
                                 f"have its param's {p.numel()} elements")
        if p.dtype not in _TL_DTYPES:
            raise TypeError(f"param {i} is {p.dtype}; the kernel takes float32, float16 or bfloat16")


def default_config(capability: int | None) -> dict[str, int]:
    """Elements per program, warps and stages of the fused launch on a GPU of ``capability`` (None:
    the CPU interpreter, where the same values serve)."""
    # 1024 elements at 4 warps: 8 per thread, two 16-byte loads of each fp32 stream. No loop, so a
    # single stage: there is nothing for a software pipeline to prefetch.
    return {"block": 1024, "num_warps": 4, "num_stages": 1}


def fused_adamw(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, eps, weight_decay,
                masters=None, kernel=None, block=None) -> int:
    """AdamW as one Triton launch per (param dtype, has master) group; returns the number of launches.
    ``kernel`` replaces ``_fused_adamw_kernel`` and gets lab 04's arguments (all but ``ALIGNED``);
    ``block`` is the elements per program (``default_config``'s by default)."""
    masters, _, _ = _prepare(params, grads, exp_avgs, exp_avg_sqs, masters, step, beta1, beta2)
    _validate_fused(params, grads, exp_avgs, exp_avg_sqs, masters)
    config = default_config(device.capability(params[0]) if params else None)
    block = config["block"] if block is None else block
    if type(block) is not int or block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block!r}")
    launches = 0
    rows = zip(params, grads, exp_avgs, exp_avg_sqs, masters)
    for (dtype, has_master), lists in _group(rows, lambda r: (r[0].dtype, r[4] is not None)).items():
        table = multi_tensor_table(lists if has_master else lists[:4], block)
        if table.n_chunks == 0:
            continue
        alignment = {"ALIGNED": table.aligned} if kernel is None else {}
        # Without masters the param table stands in for the master one, which the kernel then ignores.
        (kernel or _fused_adamw_kernel)[(table.n_chunks,)](
            *table.addrs[:4], table.addrs[4 if has_master else 0], table.numels, table.chunk_tensor,
            table.chunk_start, int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            PARAM_DTYPE=_TL_DTYPES[dtype], HAS_MASTER=has_master, BLOCK=block, **alignment,
            num_warps=config["num_warps"], num_stages=config["num_stages"])
        launches += 1
    return launches


IMPLS = {"loop": adamw_ref, "foreach": adamw_foreach, "fused": fused_adamw}


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's contract on ``impl`` "loop", "foreach" or "fused" (the Triton kernel).

    Moments are fp32 (and contiguous) whatever the parameter's dtype; ``master_weights`` gives each bf16
    or fp16 parameter an fp32 ``state[p]["master"]``; ``launches`` counts the last step's fused launches."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, impl="fused",
                 master_weights=False, kernel=None, amsgrad=False, maximize=False):
        if amsgrad or maximize:
            raise ValueError("amsgrad and maximize are not supported by this AdamW")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
        # torch.optim.AdamW's checks and messages.
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.impl, self.master_weights, self.kernel, self.launches = impl, master_weights, kernel, 0

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg"], state["exp_avg_sq"] = zeros, zeros.clone()
            if self.master_weights and p.dtype in (torch.float16, torch.bfloat16):
                state["master"] = p.detach().to(torch.float32, copy=True)
        return state

    def load_state_dict(self, state_dict) -> None:
        """torch's, except that the moments and masters stay fp32 (torch casts them to the param's dtype)."""
        super().load_state_dict(state_dict)
        saved = [state_dict["state"].get(i, {}) for group in state_dict["param_groups"] for i in group["params"]]
        for p, state in zip((p for group in self.param_groups for p in group["params"]), saved):
            self.state[p].update({k: v.to(p.device, torch.float32, copy=True) for k, v in state.items() if k != "step"})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, [p for p in group["params"] if p.grad is not None]) for group in self.param_groups]
        if any(p.grad.is_sparse for _, ps in todo for p in ps):
            raise RuntimeError("AdamW does not support sparse gradients")
        devices = defaultdict(list)
        for n, p in enumerate(p for _, ps in todo for p in ps):
            devices[str(p.device)].append(n)
        if len(devices) > 1:
            raise ValueError("AdamW: parameters with a grad (numbered in order) on several devices: "
                             + "; ".join(f"{d}: {ids}" for d, ids in devices.items()))
        self.launches = 0
        for group, params in todo:
            rows = []
            for p in params:
                state = self._state(p)
                state["step"] += 1
                rows.append((p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], state.get("master")))
            # Parameters skipped on some steps (grad None) have their own count: one call per count.
            by_step = _group(rows, lambda r: int(self.state[r[0]]["step"].item()))
            beta1, beta2 = group["betas"]
            extra = {"kernel": self.kernel} if self.impl == "fused" else {}
            for step, (ps, gs, ms, vs, ws) in by_step.items():
                launched = IMPLS[self.impl](ps, gs, ms, vs, step, lr=group["lr"], beta1=beta1, beta2=beta2,
                                            eps=group["eps"], weight_decay=group["weight_decay"], masters=ws, **extra)
                self.launches += launched or 0
        return loss


def compiled(capability: int = 90, dtype: torch.dtype = torch.float32, has_master: bool = False, *, kernel=None,
             block: int | None = None, aligned: bool = True):
    """Triton's compiled fused kernel (or ``kernel``, lab 04's arguments) for an NVIDIA GPU of
    ``capability``, no GPU needed, at ``default_config(capability)`` (``block`` overrides its block):
    what ``fused_adamw`` launches there, on tensors PyTorch allocated unless ``aligned`` is False."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"dtype must be one of {list(_TL_DTYPES)}, got {dtype}")
    config = default_config(capability)
    # The eight tables, the step count, then the five hyper-parameters.
    names = _fused_adamw_kernel.fn.__code__.co_varnames
    signature = {**dict.fromkeys(names[:8], "*i64"), "step": "i32", **dict.fromkeys(names[9:14], "fp32")}
    constexprs = {"PARAM_DTYPE": _TL_DTYPES[dtype], "HAS_MASTER": has_master, "BLOCK": block or config["block"]}
    if kernel is None:
        constexprs["ALIGNED"] = aligned
    return triton_aot.compile_kernel(kernel or _fused_adamw_kernel, signature, constexprs, capability=capability,
                                     num_warps=config["num_warps"], num_stages=config["num_stages"])


def ptx(capability: int = 90, dtype: torch.dtype = torch.float32, has_master: bool = False, *, kernel=None,
        block: int | None = None, aligned: bool = True) -> str:
    """PTX of ``compiled(...)``."""
    return compiled(capability, dtype, has_master, kernel=kernel, block=block, aligned=aligned).asm["ptx"]


def compiled_step_graphs(lr_as_tensor: bool, steps: int = 6, layers: int = 4, d: int = 64,
                         backend: str | Callable | None = None) -> dict:
    """``torch.optim.AdamW.step`` under ``torch.compile``, with a ``LinearLR`` schedule changing the
    learning rate every step: how many graphs Dynamo made, and each step's wall time.

    A Python float learning rate enters the first graph as a constant, so the scheduler's first
    change recompiles (Dynamo then treats the float as a symbol); a 0-d tensor learning rate is an
    input from the start, one graph for every step. ``backend`` defaults to one that counts the
    graphs and runs them as traced (no code generation, so the count costs only tracing); give
    ``"inductor"`` to time generated code, whose graphs this then does not count (``graphs`` None).
    Returns ``graphs`` and ``seconds`` (per step, the first including tracing and compiling).
    """
    import time

    torch._dynamo.reset()  # graphs of an earlier call would be reused, and not counted
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(d, d, generator=gen)) for _ in range(layers)]
    for p in params:
        p.grad = torch.randn(d, d, generator=gen)
    lr = torch.tensor(1e-3) if lr_as_tensor else 1e-3
    opt = torch.optim.AdamW(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=steps)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counted = backend is None

    @torch.compile(backend=counting if counted else backend)
    def step():
        opt.step()

    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        schedule.step()
    torch._dynamo.reset()
    return {"graphs": len(graphs) if counted else None, "seconds": seconds}


def adamw_bytes(numel: int, param_dtype: torch.dtype, has_master: bool) -> int:
    """Least DRAM traffic of one AdamW step: read and write param (or master), m, v; read the grad;
    with a master the 16-bit param is only written (bf16 with a master moves as much as fp32 alone)."""
    return numel * (2 * param_dtype.itemsize + 24 if has_master else 3 * param_dtype.itemsize + 16)


def _transformer(layers: int, d: int) -> list[tuple[int, ...]]:
    """A transformer's tensors: per block fused qkv, attention output, two MLP matrices, biases, 2 LayerNorms."""
    return ([(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)] + [(d,)] * 4) * layers


# Benchmark spec: one optimizer step per call; GB/s are adamw_bytes over the median time. torch rows
# step fp32 tensors: for "bf16+master" the masters with fp32 grads, then a copy into the bf16 params.
# The interpreter row times Python running the kernel on a small list, not the kernel's speed.
BENCHMARK = {
    "name": "optim",
    "cases": {"transformer 12x256": _transformer(12, 256), "transformer 12x768": _transformer(12, 768),
              "small 100x512": [(512,)] * 100, "small 10x1024": [(1024,)] * 10},
    "runs": {"cpu": [*itertools.product(("loop", "foreach", "torch_loop", "torch_foreach", "torch_fused"),
                                        ("transformer 12x256", "small 100x512")), ("interpreter", "small 10x1024")],
             "gpu": [*itertools.product(("triton", "foreach", "torch_foreach", "torch_fused"),
                                        ("transformer 12x768", "small 100x512"))]},
    "precisions": {"fp32": torch.float32, "bf16+master": torch.bfloat16},
    "hyper": {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2},
}


def _step_fn(variant: str, shapes, dtype: torch.dtype, dev: str) -> Callable:
    params = [checks.randn(s, dtype=dtype, seed=i, device=dev) for i, s in enumerate(shapes)]
    grads = [checks.randn(s, dtype=dtype, seed=1000 + i, device=dev, scale=1e-2) for i, s in enumerate(shapes)]
    hp = BENCHMARK["hyper"]
    if not variant.startswith("torch_"):
        moments = [[torch.zeros(s, device=dev) for s in shapes] for _ in range(2)]
        masters = [p.float() for p in params] if dtype != torch.float32 else None
        impl = {"loop": adamw_ref, "foreach": adamw_foreach}.get(variant, fused_adamw)
        return lambda: impl(params, grads, *moments, 10, masters=masters, **hp)
    leaves = [p.float() for p in params]
    for leaf, g in zip(leaves, grads):
        leaf.grad = g.float()
    opt = torch.optim.AdamW(leaves, lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=variant == "torch_foreach",
                            fused=True if variant == "torch_fused" else None)

    def torch_step():
        opt.step()
        if dtype != torch.float32:
            torch._foreach_copy_(params, leaves)
    return torch_step


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Time one step of every variant of the spec this machine can run; one dict per measurement."""
    where, dev = ("gpu", "cuda") if device.has_gpu() else ("cpu", "cpu")
    if where == "cpu":
        log("triton: needs a GPU (the interpreter row times Python, not the kernel)")
    rows = []
    for (precision, dtype), (variant, case) in itertools.product(BENCHMARK["precisions"].items(),
                                                                 BENCHMARK["runs"][where]):
        shapes = BENCHMARK["cases"][case]
        try:
            fn = _step_fn(variant, shapes, dtype, dev)
            launches = fn()
        except RuntimeError as err:
            log(f"{variant} {case} {precision}: needs a torch build that runs it on {dev} ({err})")
            continue
        # Every variant interleaved with torch's foreach step (itself included, a measure of the
        # noise): a busy neighbour or a clock change then hits both sides of the ratio alike.
        cmp = timing.compare(fn, _step_fn("torch_foreach", shapes, dtype, dev), reps=reps)
        t, speedup = cmp.candidate, cmp.speedup
        numel = sum(torch.Size(s).numel() for s in shapes)
        row = {"op": "adamw", "variant": variant, "case": case, "tensors": len(shapes), "numel": numel,
               "precision": precision, "median_s": t.median, "iqr_s": t.iqr,
               "gbs": adamw_bytes(numel, dtype, dtype != torch.float32) / t.median / 1e9,
               "speedup_vs_torch_foreach": speedup, "ci_low": cmp.ci_low, "ci_high": cmp.ci_high,
               "launches": launches if isinstance(launches, int) else None}
        rows.append(row)
        log(f"{variant:>13} {case:>18} {precision:>11}: {t.median * 1e3:9.3f} ms {row['gbs']:7.2f} GB/s "
            f"{speedup:6.3g}x torch foreach")
    return rows


def check() -> None:
    """foreach and fused against the loop over three steps on ragged shapes; raises on a mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    shapes = [(1,), (37,), (5, 7), (300,), (3, 4, 5), (1030,)]
    for dtype, impl in itertools.product((torch.float32, torch.float16, torch.bfloat16), (adamw_foreach, fused_adamw)):
        states = []
        for fn in (adamw_ref, impl):
            params = [checks.randn(s, dtype=dtype, seed=i, device=dev) for i, s in enumerate(shapes)]
            grads = [checks.randn(s, dtype=dtype, seed=50 + i, device=dev) for i, s in enumerate(shapes)]
            ms, vs = ([torch.zeros(s, device=dev) for s in shapes] for _ in range(2))
            masters = [p.float() for p in params] if dtype != torch.float32 else None
            for step in (1, 2, 3):
                fn(params, grads, ms, vs, step, masters=masters, **{**BENCHMARK["hyper"], "lr": 0.05})
            states.append({"param": params, "exp_avg": ms, "exp_avg_sq": vs, "master": masters or []})
        for name, tensors in states[1].items():
            for i, (a, e) in enumerate(zip(tensors, states[0][name])):
                # A 16-bit param may be a unit apart (checks' bf16 and fp16 tolerances allow it).
                checks.assert_close(a, e, name=f"{impl.__name__} {dtype} {name} {i}")
    print("optim: checks passed")


if __name__ == "__main__":
    check()
    benchmark()
