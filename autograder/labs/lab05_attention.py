"""Graded items of lab 05 flash attention: FlashAttention in PyTorch (forward, backward and what it
keeps), the Triton forward kernel, the backward kernels (a core and an optional part), O(N)
memory of the student's wiring, speed."""

from __future__ import annotations

import torch

from autograder.engine.items import Item, LabSpec, Verdict
from autograder.labs import _common
from autograder.labs._common import on_device, per_case, require_tensor, triton_kernel
from autograder.labs._attention_torch import TORCH_ITEM
from fastdl_lab import checks

# Bound before any student cell runs (see lab01_gemm). In the child these come from the student
# copy of the package, whose FlashAttentionFunction is an exercise: the grader wires the kernels
# into autograd itself (below), so the kernel items do not depend on the student's wiring.
from fastdl_lab.attention import STUDENT_KERNELS, backward_parts, launch_forward
from fastdl_lab.attention import flash_attention as _flash_attention
from fastdl_lab.memory import saved_tensor_bytes as _saved_tensor_bytes


class _GraderWiring(torch.autograd.Function):
    """The forward kernel behind autograd, without the student's wiring (the kernel items run no backward)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, kernels, config):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d).contiguous() for t in (q, k, v))
        o3, _ = launch_forward(kernels["fwd"], q3, k3, v3, causal, scale, config)
        return o3.view(q.shape)


def _qkv(case: dict) -> list[torch.Tensor]:
    return [on_device(case[name]) for name in ("q", "k", "v")]


def _kernels(ns: dict, *keys: str) -> dict:
    return {key: triton_kernel(ns, STUDENT_KERNELS[key]) for key in keys}


def _cases(seed: int, rows) -> list[dict]:
    cases = []
    for i, (b, h, n, d, causal, dtype, block_m, block_n) in enumerate(rows):
        shape = (b, h, n, d)
        q, k, v, do = (checks.randn(*shape, dtype=getattr(torch, dtype), seed=(seed + 4 * i + j) % (1 << 31))
                       for j in range(4))
        cases.append({"q": q, "k": k, "v": v, "do": do, "causal": bool(causal), "block_m": block_m, "block_n": block_n})
    return cases


def _label(c: dict) -> str:
    return (f"{tuple(c['q'].shape)} {str(c['q'].dtype)[6:]} {'causal' if c['causal'] else 'full'} "
            f"blocks {c['block_m']}x{c['block_n']}")


def _run(c: dict, kernels: dict, function=_GraderWiring, requires_grad: bool = False) -> torch.Tensor:
    q, k, v = (on_device(c[name]).clone().requires_grad_(requires_grad) for name in ("q", "k", "v"))
    out = _flash_attention(q, k, v, causal=c["causal"], kernels=kernels, block_m=c["block_m"],
                           block_n=c["block_n"], function=function)
    return out, (q, k, v)


def fwd_inputs(seed: int, params: dict) -> dict:
    return {"cases": _cases(seed, params["cases"])}


def fwd_drive(ns: dict, inputs: dict) -> list:
    kernels = _kernels(ns, "fwd")
    with torch.no_grad():
        return [_run(c, kernels)[0].cpu() for c in inputs["cases"]]


def fwd_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.attention import check_attention

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(outputs).__name__}")
    labels = [_label(c) for c in cases]

    def check_one(i: int) -> None:
        c = cases[i]
        require_tensor(outputs[i], f"o for {labels[i]}")
        # On the device the kernel ran on: there fp32 tl.dot means TF32, and the baseline follows.
        check_attention(on_device(outputs[i]), *_qkv(c), c["causal"], name=f"o for {labels[i]}")

    return per_case(labels, check_one)


# The backward: a core (delta and the dK/dV kernel) and an optional part (the dQ kernel), each fed
# by the reference forward's o and logsumexp (``backward_parts``), so that neither depends on the
# forward kernel or on the other.
CORE_BWD = ("bwd_preprocess", "bwd_dkdv")
OPTIONAL_BWD = ("bwd_dq",)


def _bwd_drive(ns: dict, inputs: dict, keys: tuple[str, ...]) -> list:
    kernels = _kernels(ns, *keys)
    results = []
    for c in inputs["cases"]:
        q, k, v, do = (on_device(c[name]) for name in ("q", "k", "v", "do"))
        parts = backward_parts(q, k, v, do, kernels, causal=c["causal"], block_m=c["block_m"], block_n=c["block_n"])
        results.append({name: t.cpu() for name, t in parts.items()})
    return results


def bwd_drive(ns: dict, inputs: dict) -> list:
    return _bwd_drive(ns, inputs, CORE_BWD)


def dq_drive(ns: dict, inputs: dict) -> list:
    return _bwd_drive(ns, inputs, OPTIONAL_BWD)


def _bwd_check(inputs: dict, outputs, names: tuple[str, ...]) -> Verdict:
    from fastdl_lab.attention import check_attention_grads

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} sets of gradients, got {type(outputs).__name__}")
    labels = [_label(c) for c in cases]

    def check_one(i: int) -> None:
        c, result = cases[i], outputs[i]
        if not isinstance(result, dict):
            raise AssertionError(f"expected gradients by name, got {type(result).__name__}")
        for name in names:
            require_tensor(result.get(name), f"{name} for {labels[i]}")
        check_attention_grads({name: on_device(result[name]) for name in names}, *_qkv(c), on_device(c["do"]),
                              c["causal"], name=labels[i])

    return per_case(labels, check_one)


def bwd_check(inputs: dict, outputs, params: dict) -> Verdict:
    return _bwd_check(inputs, outputs, ("dk", "dv"))


def dq_check(inputs: dict, outputs, params: dict) -> Verdict:
    return _bwd_check(inputs, outputs, ("dq",))


def memory_inputs(seed: int, params: dict) -> dict:
    b, h, n, d = params["shape"]
    rows = [(b, h, n, d, True, "float32", None, None), (b, h, 2 * n, d, True, "float32", None, None)]
    return {"cases": _cases(seed, rows)}


def memory_drive(ns: dict, inputs: dict) -> dict:
    """The student's own autograd wiring around their forward kernel: what does it keep?"""
    kernels = _kernels(ns, "fwd")
    function = ns.get("FlashAttention")
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError("the wiring cell must define class FlashAttention(torch.autograd.Function)")
    saved, outs = [], []
    for c in inputs["cases"]:
        leaves = [on_device(c[name]).clone().requires_grad_() for name in ("q", "k", "v")]
        saved.append(_saved_tensor_bytes(
            lambda q, k, v: _flash_attention(q, k, v, causal=c["causal"], kernels=kernels, function=function), *leaves))
        out, _ = _run(c, kernels, function=function, requires_grad=True)
        outs.append(out.detach().cpu())
    return {"saved_bytes": saved, "outputs": outs}


def memory_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.attention import check_attention

    cases = inputs["cases"]
    try:
        for c, out in zip(cases, outputs["outputs"], strict=True):
            require_tensor(out, f"o for {_label(c)}")
            check_attention(on_device(out), *_qkv(c), c["causal"], name=f"o for {_label(c)}")
    except (AssertionError, ValueError) as exc:
        return Verdict.failed(f"the wired attention is wrong: {str(getattr(exc, 'report', exc))[:500]}")
    small, large = (int(b) for b in outputs["saved_bytes"])
    b, h, n2, _ = cases[1]["q"].shape
    scores = b * h * n2 * n2 * cases[1]["q"].element_size()
    figures = {"saved_bytes_n": small, "saved_bytes_2n": large, "scores_bytes_2n": scores}
    if large >= scores:
        return Verdict.failed(f"{large} bytes saved for backward at N={n2}: at least one N x N matrix "
                              f"({scores} bytes) is kept", **figures)
    if large > 2 * small + 64:
        return Verdict.failed(f"doubling N took the saved bytes from {small} to {large}: more than linear", **figures)
    return Verdict.passed(f"saves {small} bytes at N={n2 // 2} and {large} at N={n2}: linear, "
                          f"no N x N matrix ({scores} bytes at N={n2})", **figures)


def speed_inputs(seed: int, params: dict) -> dict:
    b, h, n, d = params.get("shape", [4, 16, 2048, 64])
    return {"cases": _cases(seed, [(b, h, n, d, True, "float16", None, None)])}


def speed_timed(ns: dict, inputs: dict):
    kernels = _kernels(ns, "fwd")
    c = inputs["cases"][0]
    q, k, v = (on_device(c[name]) for name in ("q", "k", "v"))
    return lambda: [_flash_attention(q, k, v, causal=True, kernels=kernels, function=_GraderWiring)]


def speed_baseline(_ns: dict, inputs: dict):
    import torch.nn.functional as F

    c = inputs["cases"][0]
    q, k, v = (on_device(c[name]) for name in ("q", "k", "v"))
    return lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=True)]


def speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    return fwd_check(inputs, [o.cpu() for o in outputs], params)


FORWARD = (STUDENT_KERNELS["fwd"],)
# The wiring is graded on its own: only the cell's classes and functions (screened) run, with these
# names and the forward kernel, so no code of the student's can rewrite what the driver measures.
MEMORY_SCOPE = "import torch\nfrom fastdl_lab import attention\n"
MEMORY_INSTRUMENTS = ("autograder.labs.lab05_attention._saved_tensor_bytes",
                      "autograder.labs.lab05_attention._flash_attention", *_common.SAVED_TENSOR_INSTRUMENTS)

LAB = LabSpec(
    name="05_attention",
    preamble="from fastdl_lab import device\n",
    items=[
        TORCH_ITEM,
        Item("attention_fwd", 4, ("attn_fwd_code",), fwd_inputs, fwd_drive, fwd_check,
             kernels=FORWARD, description="Triton FlashAttention forward: ragged lengths, causal and not, head dims, fp32/fp16"),
        Item("attention_bwd", 3, ("attn_bwd_code",), fwd_inputs, bwd_drive, bwd_check,
             kernels=tuple(STUDENT_KERNELS[key] for key in CORE_BWD),
             description="the core backward: delta, then dK and dV recomputed from Q, K and the logsumexp"),
        Item("attention_bwd_dq", 1, ("attn_bwd_dq_code",), fwd_inputs, dq_drive, dq_check,
             kernels=tuple(STUDENT_KERNELS[key] for key in OPTIONAL_BWD),
             description="optional: the dQ kernel, one program per query block"),
        Item("attention_memory", 2, ("attn_fwd_code", "attn_function_code"), memory_inputs, memory_drive,
             memory_check, kind="mechanism", kernels=FORWARD, artefacts=("FlashAttention",), scope=MEMORY_SCOPE,
             instruments=MEMORY_INSTRUMENTS, description="the student's autograd wiring keeps nothing N x N"),
        Item("attention_speed", 2, ("attn_fwd_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=FORWARD, description="forward vs scaled_dot_product_attention (GPU)"),
    ],
)
