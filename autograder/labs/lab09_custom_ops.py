"""Graded items of lab 09 custom ops: a C++ extension of the LLTM cell, per-channel int8 weights, a
W8A8 Triton matmul, and quantisation-aware training that beats post-training quantisation.

- The C++ source is a string constant of the student's cell (``Item.built``), read by the grader
  without running the cell. A sandboxed build child compiles it with the shared precompiled parts
  (``sources.build_library``: the tensor header and the bindings, ``pch``) within the item's
  build allowance (``Item.build_s``) and loads nothing: a build error is an ``error`` verdict
  quoting the compiler's first error line. The shared object, the source's object file and the
  preprocessed unit come back as bytes, and the grader judges them (``_cpp_screen``): what the
  compiler saw after every macro and header, and the symbols the objects leave undefined (no
  Python C API, dynamic loader, process, file or environment calls, no autograd: the backward is
  hand-written). Only then does a second child, the student's, load the grader's copy of the
  approved shared object, run forward and backward on hidden inputs, and return tensors, which
  the parent compares with autograd's gradient of the reference in float64 (what ``gradcheck``
  checks numerically).
- The quantiser's codes and scales come back to the parent, which holds the hidden weights. The
  library's quantizers and fake-quantize ops are refused by name (``LIBRARY``) and, in the child,
  at torch's dispatcher (``_refusals``).
- The int8 kernel is extracted and compiled (``Item.kernels``) and launched by the course's launcher
  on hidden ragged shapes, deep enough in K that a float accumulator would round; the parent
  requires the integer reference bit for bit.
- QAT trains with the student's fake-quant function in the child, on the training points and from
  the float weights the parent sends (never the task's seed, from which the test points would
  follow); the trained weights come back and the parent evaluates them, and the post-training
  baseline it computes itself, on test points the child never sees, always rounding with the
  package's own fake-quant.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

from autograder.engine.items import Built, BuildRefused, Item, LabSpec, Verdict
from autograder.labs import _cpp_screen
from autograder.labs._common import failure_text, on_device, per_case, require_tensor, triton_kernel

KERNEL = "int8_matmul_kernel"
SCOPE = "import math\nimport torch\nimport torch.nn.functional as F\n"
# torch's quantizers, observers and fake-quantize functions, in any of their homes (torch.ao,
# torch.quantization), and the quantized dtypes and tensors' accessors.
LIBRARY = r"quantiz|^ao$|observer|^q(?:u?int\d|_per_channel|_scale|_zero_point)|int_repr"
# Run by the quantiser's and the fake-quant's children before the student's code exists.
QUANT_SCOPE = SCOPE + ("from autograder.labs._refusals import refuse_quantizers as _refuse\n"
                       "_refuse()\ndel _refuse\n")
# The extension's name in the build and in the student's child (its module's entry point).
EXTENSION = "student_lltm"
LIBRARY_FILE = f"{EXTENSION}.so"


class BuildFailed(RuntimeError):
    """The student's C++ did not compile; the message is the compiler's first error line."""


# --- the C++ extension ----------------------------------------------------------------------------


def cpp_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab import checks
    from fastdl_lab.custom.lltm import make_inputs

    shapes = params.get("shapes", [[3, 5, 7], [16, 32, 128], [1, 9, 4]])
    cases = []
    for i, (batch, features, state) in enumerate(shapes):
        tensors = make_inputs(batch, features, state, dtype=torch.float64, seed=(seed + 97 * i) % (1 << 31))
        grads = [checks.randn((batch, state), dtype=torch.float64, seed=(seed + 97 * i + 50 + j) % (1 << 31))
                 for j in range(2)]
        cases.append({"inputs": tensors, "grads": grads})
    return {"cases": cases}


def cpp_build(source: str, params: dict) -> dict:
    """In the build child: compile the source (loading nothing) and hand back what was made."""
    from fastdl_lab.custom import sources

    folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/job/.torch_extensions")) / EXTENSION
    try:
        built = sources.build_library(source, name=EXTENSION, build_dir=folder)
    except Exception as exc:  # noqa: BLE001 - whatever the build says, its first error is the reason
        raise BuildFailed(f"the C++ source does not build: {sources.first_compiler_error(str(exc))}") from None
    if built.preprocessed.stat().st_size > _cpp_screen.MAX_PREPROCESSED:
        raise BuildFailed("the preprocessed C++ source is larger than a source of the cell can be")
    return {"shared_object": built.shared_object.read_bytes(), "unit": built.unit.read_bytes(),
            "preprocessed": built.preprocessed.read_bytes(),
            # Only where the grader had no precompiled bindings to give it: the build's own.
            "bindings": (folder / "bindings.o").read_bytes() if (folder / "bindings.o").is_file() else b""}


@functools.cache
def _grader_bindings() -> frozenset[str] | None:
    """What the course's bindings object, which every build links, leaves undefined: read from the
    grader's own precompiled copy (None where it has none)."""
    from autograder.engine import elf
    from fastdl_lab.custom import pch, sources

    folder = pch.usable(sources.OPTIMISE)
    if folder is None:
        return None
    return frozenset(elf.undefined_symbols((folder / pch.BINDINGS).read_bytes()))


def cpp_screen(source: str, built, params: dict) -> dict[str, bytes]:
    """In the grader: judge the build's bytes; the approved shared object, for the student's child."""
    from autograder.engine import elf
    from fastdl_lab.custom import sources

    parts = ("shared_object", "unit", "preprocessed", "bindings")
    if not isinstance(built, dict) or not all(isinstance(built.get(part), bytes) for part in parts):
        raise BuildRefused("the build handed back no objects")
    bindings = _grader_bindings()
    if bindings is None:
        try:
            bindings = frozenset(elf.undefined_symbols(built["bindings"]))
        except elf.ElfError as exc:
            raise BuildRefused(f"the build's bindings are not an object the grader reads: {exc}") from None
    _cpp_screen.screen_preprocessed(built["preprocessed"].decode("utf-8", "replace"), sources.SOURCE_BEGINS,
                                    sources.glue(EXTENSION))
    _cpp_screen.screen_symbols(built["unit"], built["shared_object"], bindings)
    return {LIBRARY_FILE: built["shared_object"]}


def cpp_drive(ns: dict, inputs: dict) -> list:
    from fastdl_lab.custom import lltm, sources

    module = sources.load_library(ns[LIBRARY_FILE], EXTENSION)
    ops = lltm.ops_of(module, "student C++")
    results = []
    for case in inputs["cases"]:
        leaves = [t.clone().requires_grad_() for t in case["inputs"]]
        outputs = ops.forward(*[t.detach() for t in leaves])
        new_h, new_cell = lltm.lltm_cell(*leaves, ops=ops)
        grads = torch.autograd.grad((new_h, new_cell), leaves, case["grads"], allow_unused=True)
        results.append({"forward": [t.detach().clone() for t in outputs[:2]],
                        "grads": [None if g is None else g.detach().clone() for g in grads]})
    return results


def cpp_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import checks
    from fastdl_lab.custom.lltm import GRAD_NAMES, lltm_ref

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} cases back, got {type(outputs).__name__}")
    labels = ["x".join(str(s) for s in (c["inputs"][0].shape[0], c["inputs"][0].shape[1], c["inputs"][3].shape[1]))
              for c in cases]
    forward_fail, backward_fail = [], []
    for label, case, got in zip(labels, cases, outputs):
        leaves = [t.clone().requires_grad_() for t in case["inputs"]]
        want = lltm_ref(*leaves)
        want_grads = torch.autograd.grad(want, leaves, case["grads"])
        try:
            for name, g, w in zip(("new_h", "new_cell"), got["forward"], want, strict=True):
                require_tensor(g, name)
                checks.assert_close(g, w.detach(), atol=1e-10, rtol=1e-8, name=f"{label} {name}")
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            forward_fail.append(failure_text(exc) if isinstance(exc, AssertionError) else f"{label}: {exc}")
            continue
        try:
            for name, g, w in zip(GRAD_NAMES, got["grads"], want_grads, strict=True):
                require_tensor(g, f"d_{name}")
                checks.assert_close(g, w, atol=1e-9, rtol=1e-7, name=f"{label} d_{name}")
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            backward_fail.append(failure_text(exc) if isinstance(exc, AssertionError) else f"{label}: {exc}")
    if forward_fail:
        return Verdict.failed(f"forward differs from the Python cell: {forward_fail[0]}")
    if backward_fail:
        return Verdict(0.5, f"forward matches on {len(cases)} hidden shapes (float64); backward differs from "
                            f"autograd's gradient of the reference: {backward_fail[0]}")
    return Verdict.passed(f"forward and all five gradients equal the reference's (float64) on "
                          f"{', '.join(labels)}: the hand-written backward is right")


# --- per-channel int8 weights ---------------------------------------------------------------------


def quant_inputs(seed: int, params: dict) -> dict:
    from fastdl_lab import checks

    rows, cols = params.get("shape", [96, 80])
    # Channels of very different magnitude (as trained layers have), one all-zero channel, and
    # one with a single outlier: one scale for all of them would flatten the small channels.
    spread = torch.exp(checks.randn((rows, 1), seed=seed % (1 << 31), scale=1.5))
    w = checks.randn((rows, cols), seed=(seed + 1) % (1 << 31)) * spread
    w[3] = 0.0
    w[5, 7] = 40.0 * float(spread[5])
    return {"w": w, "bound": float(params.get("max_rel_error", 0.02))}


def quant_drive(ns: dict, inputs: dict) -> dict:
    q, scale = ns["quantize_per_channel"](inputs["w"].clone())
    require_tensor(q, "q")
    require_tensor(scale, "scale")
    return {"q": q.detach().cpu().clone(), "scale": scale.detach().cpu().clone()}


def quant_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.quant import formats

    w = inputs["w"]
    try:
        q, scale = outputs["q"], outputs["scale"]
        formats.check_per_channel(q, scale, w)
    except (AssertionError, KeyError, TypeError) as exc:
        return Verdict.failed(failure_text(exc) if isinstance(exc, AssertionError) else f"bad outputs: {exc}")
    restored = q.float() * scale[:, None]
    per_channel = float((restored - w).norm() / w.norm())
    per_tensor = formats.quantization_error(w, bits=8, symmetric=True, axis=None)["rel_fro"]
    details = {"relative_error": per_channel, "per_tensor_relative_error": per_tensor}
    if per_channel > inputs["bound"]:
        return Verdict.failed(f"relative error {per_channel:.2e} above {inputs['bound']:.0e}", **details)
    return Verdict.passed(f"codes and scales of {w.shape[0]} hidden channels right; relative error {per_channel:.2e} "
                          f"(one scale for the tensor: {per_tensor:.2e})", **details)


# --- the W8A8 matmul kernel -----------------------------------------------------------------------


def matmul_inputs(seed: int, params: dict) -> dict:
    gen = torch.Generator().manual_seed(seed % (1 << 31))
    cases = []
    for i, (m, n, k) in enumerate(params.get("shapes", [[70, 50, 4096], [33, 65, 100], [1, 17, 7]])):
        # The first case has codes of one sign: its sums pass 2^24, where a float32 accumulator
        # (the float path of tl.dot) starts to round and only an integer one stays exact.
        low = 64 if i == 0 else -127
        cases.append({"a": torch.randint(low, 128, (m, k), generator=gen, dtype=torch.int8),
                      "w": torch.randint(low, 128, (n, k), generator=gen, dtype=torch.int8),
                      "sa": torch.rand(m, generator=gen) * 0.05 + 1e-3, "sw": torch.rand(n, generator=gen) * 0.05 + 1e-3})
    return {"cases": cases}


def matmul_drive(ns: dict, inputs: dict) -> list:
    from fastdl_lab.quant import w8a8

    kernel = triton_kernel(ns, KERNEL)
    return [w8a8.int8_matmul(on_device(c["a"]), on_device(c["sa"]), on_device(c["w"]), on_device(c["sw"]),
                                    kernel=kernel).cpu() for c in inputs["cases"]]


def matmul_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab import checks
    from fastdl_lab.quant.w8a8 import int8_matmul_ref

    cases = inputs["cases"]
    if not isinstance(outputs, list) or len(outputs) != len(cases):
        return Verdict.failed(f"expected {len(cases)} results, got {type(outputs).__name__}")
    labels = [f"{c['a'].shape[0]}x{c['w'].shape[0]}x{c['a'].shape[1]}" for c in cases]

    def one(i: int) -> None:
        c = cases[i]
        require_tensor(outputs[i], labels[i])
        checks.assert_close(outputs[i], int8_matmul_ref(c["a"], c["sa"], c["w"], c["sw"]), atol=0.0, rtol=0.0,
                            name=labels[i])

    return per_case(labels, one)


def matmul_speed_inputs(seed: int, params: dict) -> dict:
    gen = torch.Generator().manual_seed(seed % (1 << 31))
    m, n, k = params.get("shape", [4096, 4096, 4096])
    return {"a": torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8),
            "w": torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
            "sa": torch.rand(m, generator=gen) * 0.05, "sw": torch.rand(n, generator=gen) * 0.05}


def matmul_speed_timed(ns: dict, inputs: dict):
    from fastdl_lab.quant import w8a8

    kernel = triton_kernel(ns, KERNEL)
    a, sa, w, sw = (on_device(inputs[k]) for k in ("a", "sa", "w", "sw"))
    return lambda: w8a8.int8_matmul(a, sa, w, sw, kernel=kernel)


def matmul_speed_baseline(ns: dict, inputs: dict):
    # The float16 matmul the int8 one replaces, on the same values: int8 tensor cores run at twice
    # the fp16 rate and read half the bytes.
    a, w = on_device(inputs["a"]).half(), on_device(inputs["w"]).half()
    return lambda: a @ w.T


def matmul_speed_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.quant.w8a8 import int8_matmul_ref

    if not isinstance(outputs, torch.Tensor):
        return Verdict.failed("the timed kernel returned no tensor")
    if not torch.equal(outputs.cpu(), int8_matmul_ref(inputs["a"], inputs["sa"], inputs["w"], inputs["sw"])):
        return Verdict.failed("the timed kernel's result differs from the integer reference")
    return Verdict.passed("exact")


# --- quantisation-aware training ------------------------------------------------------------------


def qat_inputs(seed: int, params: dict) -> dict:
    """The float model is trained here, once: the child starts its QAT from these weights, on the
    training points sent with them, and ``qat_check`` quantises the same weights for PTQ. The task's
    seed stays here (``withheld``): the test points and labels follow from it. It is drawn from 62
    bits, so that no search over seeds finds the one that made the training points."""
    from fastdl_lab.quant import training as qat

    task_seed = seed % (1 << 62)
    task = qat.make_task(task_seed)
    # The order of the QAT batches: a seed of its own, from which nothing of the task follows.
    shuffle = int.from_bytes(hashlib.sha256(f"qat-batches:{seed}".encode()).digest()[:4], "little")
    return {"seed": task_seed, "bits": int(params.get("bits", 4)), "steps": int(params.get("steps", 600)),
            "train_x": task.train[0], "train_y": task.train[1], "shuffle_seed": shuffle,
            "float_state": {k: v.detach().clone() for k, v in qat.train_float(task_seed).state_dict().items()}}


def _float_model(inputs: dict):
    from fastdl_lab.quant import training as qat

    # The architecture is the same for every seed; the weights are the parent's float model.
    model = qat.make_model(0)
    model.load_state_dict(inputs["float_state"])
    return model.eval()


def qat_drive(ns: dict, inputs: dict) -> dict:
    from fastdl_lab.quant import training as qat

    from fastdl_lab.quant.formats import one_thread

    train = (inputs["train_x"], inputs["train_y"])
    with one_thread():
        trained = qat.qat(_float_model(inputs), int(inputs["bits"]), int(inputs["steps"]), train,
                          fake_quant=ns["fake_quant"], seed=int(inputs["shuffle_seed"]))
    return {"state": {k: v.detach().clone() for k, v in trained.state_dict().items()}}


def qat_check(inputs: dict, outputs, params: dict) -> Verdict:
    from fastdl_lab.quant import training as qat

    seed, bits = int(inputs["seed"]), int(inputs["bits"])
    task = qat.make_task(seed)
    model = _float_model(inputs)
    ptq_accuracy = qat.accuracy(qat.ptq(model, bits, task.train[0]), task.test)
    # The student's weights in the package's quantised model: it rounds with the package's own
    # fake-quant, whatever function trained them.
    quantized = qat.ptq(model, bits, task.train[0])
    state = outputs.get("state") if isinstance(outputs, dict) else None
    try:
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError("the trained weights did not come back")
        quantized.load_state_dict(state)
    except (RuntimeError, ValueError) as exc:
        return Verdict.failed(f"the trained model does not fit the lab's: {str(exc)[:300]}")
    qat_accuracy = qat.accuracy(quantized, task.test)
    margin = float(params.get("margin", 0.10))
    details = {"ptq": ptq_accuracy, "qat": qat_accuracy, "bits": bits}
    if qat_accuracy >= ptq_accuracy + margin:
        return Verdict.passed(f"QAT {qat_accuracy:.1%} against PTQ {ptq_accuracy:.1%} at {bits}-bit weights on hidden "
                              "test points", **details)
    return Verdict.failed(f"QAT {qat_accuracy:.1%} does not beat PTQ {ptq_accuracy:.1%} by {margin:.0%}: does the "
                          "gradient pass through the rounding (straight-through estimator)?", **details)


LAB = LabSpec(
    name="09_custom_ops",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("cpp_lltm", 4, ("cpp_code",), cpp_inputs, cpp_drive, cpp_check,
             built=Built("LLTM_CPP", cpp_build, cpp_screen), build_s=180, torch_headers=True,
             description="your C++ LLTM forward and backward, built and screened by the grader, run in the sandbox: "
                         "forward equals the Python cell, gradients equal autograd's (float64)"),
        Item("per_channel_int8", 2, ("quant_code",), quant_inputs, quant_drive, quant_check,
             artefacts=("quantize_per_channel",), scope=QUANT_SCOPE, library=LIBRARY,
             description="symmetric int8 codes and one scale per output channel, on hidden weights"),
        Item("int8_matmul", 4, ("kernel_code",), matmul_inputs, matmul_drive, matmul_check, kernels=(KERNEL,),
             description="the W8A8 Triton kernel: bit-exact against the integer reference on hidden ragged shapes"),
        Item("qat_beats_ptq", 3, ("qat_code",), qat_inputs, qat_drive, qat_check, artefacts=("fake_quant",),
             scope=QUANT_SCOPE, library=LIBRARY, withheld=("seed",),
             description="training with your fake-quant recovers what post-training quantisation loses"),
        Item("int8_matmul_speed", 2, ("kernel_code",), matmul_speed_inputs, kind="speed", check=matmul_speed_check,
             timed=matmul_speed_timed, baseline=matmul_speed_baseline, kernels=(KERNEL,),
             description="the int8 kernel against the fp16 matmul it replaces (GPU profiles)"),
    ],
)
