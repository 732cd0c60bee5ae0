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
from fastdl_lab.memory import _saved_storages


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
    """A small ragged case, then the large one the memory is judged on (``params["shape"]``, with
    ``params["blocks"]`` as the kernel's tiles: large tiles keep the interpreter's programs few)."""
    b, h, n, d = params["shape"]
    block_m, block_n = params.get("blocks", (None, None))
    rows = [(1, 2, 100, d, True, "float32", None, None), (b, h, n, d, True, "float32", block_m, block_n)]
    return {"cases": _cases(seed, rows)}


def memory_drive(ns: dict, inputs: dict) -> dict:
    """The student's autograd wiring around their forward kernel, forward and backward, on each case.

    The wiring's backward calls ``attention.launch_backward``, which in this child is the grader's
    stand-in (``_attention_memory.host_backward``). The small case runs first: the forward kernel is
    compiled for sm_90 at its first launch, which at the large case's tiles would take minutes.
    The saved bytes are counted on the graded calls themselves, in this process: a hint for the
    reason, never a score."""
    # The interpreter makes a few numpy temporaries of a tile (1 MiB at 512 x 512) per operation:
    # mapping each one anew would take four times the forward's time. Below 4 MiB they come from the
    # heap; q, k, v and their gradients are 512 KiB each, an N x N matrix 256 MiB, always mapped.
    _common.exact_peaks(4 << 20)
    kernels = _kernels(ns, "fwd")
    function = ns.get("FlashAttention")
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError("the wiring cell must define class FlashAttention(torch.autograd.Function)")
    results = []
    for c in inputs["cases"]:
        leaves = [on_device(c[name]).clone().requires_grad_() for name in ("q", "k", "v")]
        out, saved = _saved_storages(
            lambda q, k, v: _flash_attention(q, k, v, causal=c["causal"], kernels=kernels, block_m=c["block_m"],
                                             block_n=c["block_n"], function=function), leaves)
        # A scalar loss: grad_outputs would have autograd import sympy in this fresh process.
        grads = torch.autograd.grad((out * on_device(c["do"])).sum(), leaves, allow_unused=True)
        results.append({"o": out.detach().cpu(), "grads": [None if g is None else g.cpu() for g in grads],
                        "saved_bytes": int(sum(saved.values()))})
    return results


def memory_check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    from autograder.labs._attention_memory import check_case

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(outputs).__name__}")
    try:
        for c, r in zip(cases, outputs):
            label = _label(c)
            if not isinstance(r, dict) or not isinstance(r.get("grads"), list) or len(r["grads"]) != 3:
                raise AssertionError(f"{label}: expected an output and three gradients")
            for value, name in zip((r.get("o"), *r["grads"]), ("o", "dq", "dk", "dv")):
                require_tensor(value, f"{name} for {label}")
            check_case(r["o"], r["grads"], c["q"], c["k"], c["v"], c["do"], c["causal"], label)
    except AssertionError as exc:
        return Verdict.failed(f"the wired attention is wrong (forward and backward): {_common.failure_text(exc)[:400]}")
    b, h, n, _ = cases[-1]["q"].shape
    scores = b * h * n * n * 4
    kept, memory, figures = _common.peak_verdict(
        observed, params, f"at N={n}", f"an N x N fp32 matrix is {_common.mib(scores)}")
    hint = outputs[-1].get("saved_bytes")
    figures = {**figures, "scores_bytes": scores, "saved_bytes_self_reported": hint}
    if kept:
        return Verdict.passed(f"forward and backward correct; {memory}", **figures)
    hint = f"; your process counted {_common.mib(hint)} saved (self-reported, not scored)" \
        if isinstance(hint, int) else ""
    return Verdict.failed(f"forward and backward correct, but {memory}{hint}", **figures)


def memory_reference(inputs: dict) -> dict:
    """The course's forward kernel and wiring, its backward going to the same stand-in as the student's."""
    from autograder.engine.child import _prove_kernels_compile
    from autograder.labs._attention_memory import host_backward
    from fastdl_lab.attention import forward, function

    # A trusted child: the package's own wiring calls launch_backward by its module's name.
    function.launch_backward = host_backward
    # The student's kernel is compiled for sm_90 at its first launch, and the compiler's memory
    # stays in the child's peak: the course's kernel is compiled the same way here.
    _prove_kernels_compile(vars(forward))
    return {STUDENT_KERNELS["fwd"]: function.KERNELS["fwd"], "FlashAttention": function.FlashAttentionFunction}


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
# names and the forward kernel. Its ``attention`` is the package's with the grader's backward in
# place of launch_backward's kernels (``_attention_memory``). The memory is the cgroup's peak of the
# child, on the host even on a GPU profile, against a reference child running the course's wiring.
MEMORY_SCOPE = "import torch\nfrom autograder.labs._attention_memory import attention\n"
MEMORY_INSTRUMENTS = ("autograder.labs.lab05_attention._saved_storages",
                      "autograder.labs.lab05_attention._flash_attention",
                      "autograder.labs._attention_memory.host_backward", *_common.SAVED_TENSOR_INSTRUMENTS)

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
             instruments=MEMORY_INSTRUMENTS, reference=memory_reference, reference_run=True, host_only=True,
             description="the student's wiring, forward and backward at a large N: nothing N x N kept"),
        Item("attention_speed", 2, ("attn_fwd_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=FORWARD, description="forward vs scaled_dot_product_attention (GPU)"),
    ],
)
