"""Lab 05's ``flash_torch`` item: the student's FlashAttention in PyTorch, an ``autograd.Function``.

Half the points for the forward and the gradients on hidden shapes (ragged against the key
block, causal and not), judged in the parent against float64 attention by the rule of
``check_attention``. Half for memory, on one more forward and backward at an N where a single
N x N fp32 matrix is hundreds of MiB (``params["memory"]``): its output and gradients are checked
the same way, and its memory is the peak of the child's cgroup, the kernel's count of every
thread, process and tmpfs file of the child, compared with a reference child that runs the same
driver with the course's ``FlashAttentionTorch`` (``Item.reference_run``). Scores kept anywhere,
created whole for a moment, in a helper thread or process, as NumPy or Python numbers: each is
memory the child holds at its peak. The child also counts, on a small call of its own (N = 512),
what the forward saves, keeps and creates (``fastdl_lab.memory.footprint``): figures of the
student's process, shown in the reason as a hint and never scored. Only the screened class and
functions of the cell reach the child (``Item.artefacts``): no import, no library attention, no
compiled code.
"""

from __future__ import annotations

import dataclasses

import torch

from autograder.engine.items import Item, Verdict
from autograder.labs import _common
from autograder.labs._common import on_device, per_case, require_tensor
from fastdl_lab import checks
# Bound before the artefacts are defined: the in-child counts the reason shows as a hint.
from fastdl_lab.memory import footprint as _footprint

CLASS = "FlashAttentionTorch"
# The length of the call the child's own counts are taken on (a hint in the reason).
HINT_N = 512
SCOPE = "import math\nimport torch\nimport torch.nn.functional as F\n"
LIBRARY = r"attention|^(numpy|tolist|storage|untyped_storage|set_|resize_|resize_as_|compile|jit|data|fx)$"
# Graded code cannot name these, but a method's ``ctx`` or ``self`` can be handed a class and
# assign to it: a replaced method is tampering, whatever the figures it would have changed.
INSTRUMENTS = (*_common.SAVED_TENSOR_INSTRUMENTS, "autograder.labs._attention_torch._footprint",
               "fastdl_lab.memory.footprint", "fastdl_lab.memory._python_bytes", "torch.UntypedStorage.nbytes",
               "torch.UntypedStorage.data_ptr", "torch.Tensor.element_size")


def _draw(seed: int, rows) -> list[dict]:
    cases = []
    for i, (b, h, n, d, causal, block_n) in enumerate(rows):
        q, k, v, do = (checks.randn(b, h, n, d, seed=(seed + 4 * i + j) % (1 << 31)) for j in range(4))
        cases.append({"q": q, "k": k, "v": v, "do": do, "causal": bool(causal), "block_n": int(block_n)})
    return cases


def inputs(seed: int, params: dict) -> dict:
    b, h, n, d, block_n = params["memory"]
    hint, memory = _draw(seed + 7919, [(1, 1, HINT_N, d, True, block_n), (b, h, n, d, True, block_n)])
    return {"cases": _draw(seed, params["cases"]), "hint": hint, "memory": memory}


def _label(c: dict) -> str:
    return f"{tuple(c['q'].shape)} {'causal' if c['causal'] else 'full'} block_n={c['block_n']}"


def drive(ns: dict, inputs: dict) -> dict:
    _common.exact_peaks()
    function = ns.get(CLASS)
    if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
        raise TypeError(f"the cell must define class {CLASS}(torch.autograd.Function)")
    if getattr(function.apply, "__func__", None) is not torch.autograd.Function.apply.__func__:
        raise TypeError(f"{CLASS} must not replace apply: autograd's own apply runs forward and backward")

    def leaves(c):
        return [on_device(c[name]).clone().requires_grad_() for name in ("q", "k", "v")]

    def result(out, grads):
        return {"o": out.detach().cpu(), "grads": [None if g is None else g.cpu() for g in grads]}

    cases = []
    for c in inputs["cases"]:
        q, k, v = leaves(c)
        out = function.apply(q, k, v, c["causal"], c["block_n"])
        # A scalar loss: grad_outputs would have autograd import sympy in this fresh process.
        cases.append(result(out, torch.autograd.grad((out * on_device(c["do"])).sum(), (q, k, v), allow_unused=True)))
    # The hint: what the student's process counts on a small call (tracing Python's allocations
    # costs tens of MiB at the memory case's N, which would land in its peak).
    c = inputs["hint"]
    figures = _footprint(lambda q, k, v: function.apply(q, k, v, c["causal"], c["block_n"]), *leaves(c),
                         grad_out=on_device(c["do"]))[2]
    # The memory case: one forward and backward, the call the cgroup's peak is judged on.
    c = inputs["memory"]
    q, k, v = leaves(c)
    out = function.apply(q, k, v, c["causal"], c["block_n"])
    grads = torch.autograd.grad((out * on_device(c["do"])).sum(), (q, k, v), allow_unused=True)
    return {"cases": cases, "memory": result(out, grads), "hint": dataclasses.asdict(figures)}


def _check_case(c: dict, r) -> None:
    from fastdl_lab.attention import check_attention, check_attention_grads

    label = _label(c)
    if not isinstance(r, dict) or not isinstance(r.get("grads"), list) or len(r["grads"]) != 3:
        raise AssertionError(f"{label}: expected an output and three gradients")
    require_tensor(r["o"], f"o for {label}")
    for grad, name in zip(r["grads"], ("dq", "dk", "dv")):
        require_tensor(grad, f"{name} for {label} (backward returned None)")
    qkv = [on_device(c[name]) for name in ("q", "k", "v")]
    check_attention(on_device(r["o"]), *qkv, c["causal"], name=f"o for {label}")
    check_attention_grads([on_device(g) for g in r["grads"]], *qkv, on_device(c["do"]), c["causal"], name=label)


def _hint(figures) -> str:
    """What the child's own count saw on the hint's call: self-reported, so a hint for the student."""
    try:
        saved, kept = (int(figures[key]) // 1024 for key in ("saved_bytes", "kept_bytes"))
        shape = "x".join(str(int(n)) for n in figures["largest_shape"])
    except (TypeError, KeyError, ValueError):
        return ""
    return (f"; at N={HINT_N} your process counted {saved} KiB saved, {kept} KiB kept, largest tensor {shape} "
            "(self-reported, not scored)")


def _memory_verdict(inputs: dict, memory, hint, params: dict, observed) -> tuple[bool, str, dict]:
    """(passed, reason, figures) for the memory case: right values, then the cgroup's peak."""
    from autograder.labs._attention_memory import check_case

    c = inputs["memory"]
    b, h, n, _ = c["q"].shape
    try:
        if not isinstance(memory, dict):
            raise AssertionError("the memory case came back incomplete")
        r = memory
        if not isinstance(r.get("grads"), list) or len(r["grads"]) != 3:
            raise AssertionError("expected an output and three gradients")
        for value, name in zip((r.get("o"), *r["grads"]), ("o", "dq", "dk", "dv")):
            require_tensor(value, f"{name} at N={n}")
        check_case(r["o"], r["grads"], c["q"], c["k"], c["v"], c["do"], c["causal"], f"N={n}")
    except AssertionError as exc:
        return False, f"the memory case is wrong: {_common.failure_text(exc)[:200]}", {}
    scores = b * h * n * n * 4
    kept, reason, figures = _common.peak_verdict(
        observed, params, f"at N={n}", f"an N x N fp32 matrix is {_common.mib(scores)}")
    figures = {**figures, "scores_bytes": scores, "footprint_self_reported": hint if isinstance(hint, dict) else None}
    return kept, reason + ("" if kept else _hint(hint)), figures


def check(inputs: dict, outputs, params: dict, observed) -> Verdict:
    if not isinstance(outputs, dict):
        return Verdict.failed(f"expected results by name, got {type(outputs).__name__}")
    cases, results = inputs["cases"], outputs.get("cases")
    if not isinstance(results, list) or len(results) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(results).__name__}")
    parity = per_case([_label(c) for c in cases], lambda i: _check_case(cases[i], results[i]))
    kept, memory_reason, figures = _memory_verdict(inputs, outputs.get("memory"), outputs.get("hint"), params, observed)
    fraction = 0.5 * parity.fraction + (0.5 if kept else 0.0)
    parity_reason = parity.reason if parity.fraction < 1 else f"forward and gradients correct on all {len(cases)} cases"
    return Verdict(fraction, f"{parity_reason}; memory: {memory_reason}", figures)


def reference(inputs: dict) -> dict:
    """The course's FlashAttentionTorch, under the name the drive finds the student's."""
    from fastdl_lab.attention import FlashAttentionTorch

    return {CLASS: FlashAttentionTorch}


TORCH_ITEM = Item("flash_torch", 4, ("attn_torch_code",), inputs, drive, check, kind="mechanism",
                  artefacts=(CLASS,), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
                  reference=reference, reference_run=True, host_only=True,
                  description="FlashAttention in PyTorch: forward and gradients, and a peak with nothing N x N")
