"""Lab 05's ``flash_torch`` item: the student's FlashAttention in PyTorch, an ``autograd.Function``.

Half the points for the forward and the gradients on hidden shapes (ragged against the key
block, causal and not), judged in the parent against float64 attention by the rule of
``check_attention``; half for what it keeps and creates, measured by trusted code in the child
(``fastdl_lab.memory.footprint``) at N and 2N: saved for backward, kept alive anywhere after the
forward, left in Python objects, and the largest tensor either pass creates. Only the screened
class and functions of the cell reach the child (``Item.artefacts``): no import, no library
attention, none of the ways to keep values out of the counts' sight (NumPy, lists of numbers,
storages swapped in place) or to run operations no dispatcher sees (compiled code).
"""

from __future__ import annotations

import dataclasses

import torch

from autograder.engine.items import Item, Verdict
from autograder.labs import _common
from autograder.labs._common import on_device, per_case, require_tensor
from fastdl_lab import checks
# Bound before the artefacts are defined: the measurement the half of the points rests on.
from fastdl_lab.memory import footprint as _footprint

CLASS = "FlashAttentionTorch"
SCOPE = "import math\nimport torch\nimport torch.nn.functional as F\n"
LIBRARY = r"attention|^(numpy|tolist|storage|untyped_storage|set_|resize_|resize_as_|compile|jit|data|fx)$"
# Graded code cannot name these, but a method's ``ctx`` or ``self`` can be handed a class and
# assign to it: the figures would then rest on a replaced method.
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
    memory_rows = [(b, h, n, d, True, block_n), (b, h, 2 * n, d, True, block_n)]
    return {"cases": _draw(seed, params["cases"]), "memory": _draw(seed + 7919, memory_rows)}


def _label(c: dict) -> str:
    return f"{tuple(c['q'].shape)} {'causal' if c['causal'] else 'full'} block_n={c['block_n']}"


def drive(ns: dict, inputs: dict) -> dict:
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
    memory = []
    for c in inputs["memory"]:
        out, grads, figures = _footprint(lambda q, k, v: function.apply(q, k, v, c["causal"], c["block_n"]),
                                         *leaves(c), grad_out=on_device(c["do"]))
        memory.append({**result(out, grads), "figures": dataclasses.asdict(figures)})
    return {"cases": cases, "memory": memory}


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


def _footprint_verdict(inputs: dict, memory) -> tuple[bool, str, dict]:
    """(passed, reason, figures) for the two footprint runs, at N and 2N."""
    if not isinstance(memory, list) or len(memory) != 2:
        return False, "the footprint runs came back incomplete", {}
    try:
        for c, r in zip(inputs["memory"], memory):
            _check_case(c, r)
    except AssertionError as exc:
        return False, f"the footprint runs are wrong: {_common.failure_text(exc)[:300]}", {}
    small, large = (r["figures"] for r in memory)
    b, h, n2, _ = inputs["memory"][1]["q"].shape
    scores = b * h * n2 * n2 * 4
    figures = {f"{key}_{size}": int(fig[key]) for size, fig in (("n", small), ("2n", large))
               for key in ("saved_bytes", "kept_bytes", "python_bytes", "largest_elements")}
    for key, what in (("saved_bytes", "saved for backward"), ("kept_bytes", "kept alive after the forward"),
                      ("python_bytes", "left in Python objects by the forward")):
        if int(large[key]) >= scores:
            return False, (f"{int(large[key])} bytes {what} at N={n2}: at least one N x N fp32 matrix "
                           f"({scores} bytes)"), figures
    for key, what in (("saved_bytes", "saved for backward"), ("kept_bytes", "kept after the forward")):
        if int(large[key]) > 2 * int(small[key]) + 256:
            return False, (f"doubling N took the bytes {what} from {int(small[key])} to {int(large[key])}: "
                           "more than linear"), figures
    for c, fig in ((inputs["memory"][0], small), (inputs["memory"][1], large)):
        n = c["q"].shape[-2]
        if int(fig["largest_elements"]) >= b * h * n * n:
            return False, (f"the {fig['largest_phase']} created a tensor of {int(fig['largest_elements'])} elements "
                           f"(shape {tuple(fig['largest_shape'])}) at N={n}, as many as the N x N scores: "
                           f"tile over blocks of block_n={c['block_n']} keys, masks included"), figures
    return True, (f"saves {int(large['saved_bytes'])} bytes and keeps {int(large['kept_bytes'])} at N={n2} "
                  f"(linear; N x N is {scores}); largest tensor {int(large['largest_elements'])} elements"), figures


def check(inputs: dict, outputs, params: dict) -> Verdict:
    if not isinstance(outputs, dict):
        return Verdict.failed(f"expected results by name, got {type(outputs).__name__}")
    cases, results = inputs["cases"], outputs.get("cases")
    if not isinstance(results, list) or len(results) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(results).__name__}")
    parity = per_case([_label(c) for c in cases], lambda i: _check_case(cases[i], results[i]))
    kept, memory_reason, figures = _footprint_verdict(inputs, outputs.get("memory"))
    fraction = 0.5 * parity.fraction + (0.5 if kept else 0.0)
    parity_reason = parity.reason if parity.fraction < 1 else f"forward and gradients correct on all {len(cases)} cases"
    return Verdict(fraction, f"{parity_reason}; footprint: {memory_reason}", figures)


TORCH_ITEM = Item("flash_torch", 4, ("attn_torch_code",), inputs, drive, check, kind="mechanism",
                  artefacts=(CLASS,), scope=SCOPE, library=LIBRARY, instruments=INSTRUMENTS,
                  description="FlashAttention in PyTorch: forward and gradients, and nothing N x N kept or created")
