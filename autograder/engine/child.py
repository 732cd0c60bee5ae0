"""Entry point of a sandboxed grading child: ``python -m autograder.engine.child /job``.

The parent wrote ``job.json`` and ``inputs.pt`` into the work directory, plus either

- ``kernels.py``: the student's ``@triton.jit`` functions and constants, extracted by the parent
  (``kernels.py`` of the engine). No other student code exists in this process. Under the Triton
  interpreter each kernel is compiled ahead of time for sm_90 before its first launch, which
  proves its body is Triton and not Python in disguise; or
- ``artefacts.py``: the student's classes and functions, screened and extracted by the parent
  (``artefacts.py`` of the engine), run in the names the item's trusted ``scope`` imports and with
  a restricted set of builtins, every attribute read checked and unpickling narrowed
  (``reach.py``), with or without kernels beside them; or
- one file per solution cell, executed after the lab preamble (Python items). The instruments
  the item names are bound before the cells run and checked afterwards: a replaced one ends the
  run as ``tampered``.

Then it runs the item's ``drive`` once (mode "check"), or times the item's candidate against its
baseline with ``fastdl_lab.timing.compare`` (mode "speed"; only kernel items are timed, so only
trusted Python runs while the clock does, or extracted artefacts), and hands the outputs to the
parent as ``delivery.py`` says: written once, announced with their digest.

In mode "speed" the timing module and the clocks it reads are bound before any student code
exists here and verified unchanged before and after the timed phase (a replaced one is
``tampered``); the phase's start and end are announced on stdout (``speed.marker``) so the parent
clocks it too and can refuse samples its own clock contradicts (``speed.cross_check``).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import sys
import traceback

from autograder.engine import faults

ERROR_CHARS = 2000
# The timing harness's own functions and the clocks it bound at import (timing.INSTRUMENTS names
# the library attributes they came from).
TIMING_FUNCTIONS = ("compare", "_measure", "_num_threads", "_warm_up", "_batch_size", "_flusher", "_host_sample",
                    "_event_sample", "_device_tail", "_check_joined", "_probe_streams", "_perf_counter", "_Event",
                    "_record", "_elapsed_ms", "_wait_event", "_synchronize")


class Tampered(Exception):
    """An instrument the grade rests on was replaced by the student's code."""


class KernelNotCompiled(Exception):
    """A student "kernel" that Triton's compiler rejects: Python posing as a kernel."""


def _resolve(dotted: str):
    """``a.b.C.m``: import the longest module prefix, then follow attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted}")


def _fingerprint(obj):
    return obj, getattr(obj, "__code__", None), getattr(obj, "__defaults__", None)


class _Instruments:
    def __init__(self, names: tuple[str, ...]):
        self.bound = {name: _fingerprint(_resolve(name)) for name in names}

    def verify(self) -> None:
        for name, (obj, code, defaults) in self.bound.items():
            current = _resolve(name)
            if current is not obj or _fingerprint(obj)[1:] != (code, defaults):
                raise Tampered(f"the instrument {name} was replaced or modified by the submission")


def _prove_kernels_compile(ns: dict) -> None:
    """Compile each student kernel for sm_90 before the interpreter first runs its body."""
    from triton.runtime.interpreter import InterpretedFunction

    from fastdl_lab import triton_aot

    run, proven = InterpretedFunction.run, set()

    def checked_run(self, *args, **kwargs):
        if self.fn.__globals__ is ns and id(self) not in proven:
            try:
                triton_aot.compile_launch(self, args, kwargs, capability=90)
            except Exception as exc:  # noqa: BLE001 - whatever the compiler rejects
                raise KernelNotCompiled(f"{self.fn.__name__} does not compile for sm_90, so it is not a "
                                        f"Triton kernel: {type(exc).__name__}: {str(exc)[:300]}") from None
            proven.add(id(self))
        return run(self, *args, **kwargs)

    InterpretedFunction.run = checked_run


def _reuse_triton_key(key: str) -> None:
    """Triton names every compilation after a SHA-256 of its own installation, the 460 MB of
    libtriton included: 0.33 s on the first compile of each process. The grader hashed the same
    files once (this sandbox shows its installation, read-only) and passes the result in."""
    from triton.runtime import cache

    cache.triton_key = lambda: key


def _exec_file(path: str, ns: dict) -> None:
    with open(path) as f:
        source = f.read()
    exec(compile(source, path, "exec"), ns)


def _namespace(job: dict, workdir: str, library: str) -> dict:
    if job.get("kernel_module") or job.get("artefact_module"):
        ns: dict = {"__name__": "student_kernels"}
        if job.get("kernel_module"):
            _exec_file(os.path.join(workdir, job["kernel_module"]), ns)
            from fastdl_lab import device

            if device.interpreting():
                _prove_kernels_compile(ns)
        if job.get("artefact_module"):
            return _artefact_namespace(job, workdir, kernels=ns, library=library)
        return ns
    ns = {"__name__": "__main__"}
    exec(compile(job["preamble"], os.path.join(workdir, "preamble.py"), "exec"), ns)
    for cell in job["cells"]:
        _exec_file(os.path.join(workdir, cell["file"]), ns)
    return ns


def _artefact_namespace(job: dict, workdir: str, kernels: dict, library: str) -> dict:
    """The student's screened classes and functions, in a namespace of their own: the scope's
    names, the kernels and constants, the safe builtins and the guard every attribute read goes
    through (``reach.py``). Kernels keep their own globals (with Python's builtins, which Triton's
    compiler and interpreter need)."""
    from types import ModuleType

    from autograder.engine import reach

    ns: dict = {"__name__": "student_artefacts"}
    exec(compile(job["scope"], os.path.join(workdir, "scope.py"), "exec"), ns)
    scope_modules = frozenset(value.__name__ for value in ns.values() if isinstance(value, ModuleType))
    ns.update({name: value for name, value in kernels.items() if not name.startswith("__")})
    # Functions capture the builtins of the namespace they are defined in.
    ns["__builtins__"] = reach.extracted_builtins(scope_modules)
    reach.refuse_unpickling(library)
    _exec_file(os.path.join(workdir, job["artefact_module"]), ns)
    return ns


def _speed_instruments() -> tuple[str, ...]:
    from fastdl_lab import timing

    return tuple(f"fastdl_lab.timing.{name}" for name in TIMING_FUNCTIONS) + timing.INSTRUMENTS


def _announcer():
    """Writes the phase markers straight to the output pipe with functions bound now, before
    student code could replace them; the newline first ends any line left unfinished."""
    from autograder.engine import speed

    write = os.write
    markers = {phase: b"\n" + speed.marker(phase) for phase in speed.PHASES}
    return lambda phase: write(1, markers[phase])


def _timed(item, ns: dict, inputs: dict, params: dict, compare, announce) -> dict:
    from autograder.engine.speed import DEFAULT_REPS, DEFAULT_WARMUP

    candidate, baseline = item.timed(ns, inputs), item.baseline(ns, inputs)
    result = {}

    def run_candidate():
        result["outputs"] = candidate()

    cmp = compare(run_candidate, baseline, warmup=int(params.get("warmup", DEFAULT_WARMUP)),
                  reps=int(params.get("reps", DEFAULT_REPS)),
                  seed=int(params.get("order_seed", 0)), phase=announce,
                  min_run_s=float(params.get("min_run_s", 0.0)))
    return {"outputs": result["outputs"], "candidate_s": list(cmp.candidate.samples),
            "baseline_s": list(cmp.baseline.samples), "candidate_batch": cmp.candidate.batch,
            "baseline_batch": cmp.baseline.batch}


def _write_error(workdir: str, status: str, exc: BaseException) -> None:
    summary = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    with open(os.path.join(workdir, "error.json"), "w") as f:
        json.dump({"status": status, "error": summary, "traceback": traceback.format_exc()[-4000:]}, f)
    print(summary, file=sys.stderr)


def main(workdir: str) -> int:
    with open(os.path.join(workdir, "job.json")) as f:
        job = json.load(f)
    import torch

    from autograder.engine import delivery
    from autograder.engine.items import lab_spec

    deliver = delivery.writer()  # bound before any student code exists in this process

    item = lab_spec(job["lab"]).item(job["item"])
    inputs = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=True)
    speed = job["mode"] == "speed"
    if speed:
        from fastdl_lab import timing

        compare, announce = timing.compare, _announcer()
    if job.get("triton_key"):
        _reuse_triton_key(job["triton_key"])
    instruments = _Instruments(tuple(job.get("instruments", ())) + (_speed_instruments() if speed else ()))
    try:
        ns = _namespace(job, workdir, item.library)
        if speed:
            instruments.verify()  # before the clock starts: a patched clock never times anything
            outputs = _timed(item, ns, inputs, job["params"], compare, announce)
        else:
            outputs = item.drive(ns, inputs)
        instruments.verify()
    except Tampered as exc:
        _write_error(workdir, "tampered", exc)
        return 3
    except KernelNotCompiled as exc:
        _write_error(workdir, "not_a_kernel", exc)
        return 3
    except BaseException as exc:  # noqa: BLE001 - every failure of student code is reported
        # A replaced instrument often breaks the run it was replaced for: name the cause.
        try:
            instruments.verify()
        except Tampered as tampered:
            _write_error(workdir, "tampered", tampered)
            return 3
        _write_error(workdir, faults.child_status(exc), exc)
        return 3
    saved = io.BytesIO()
    torch.save(outputs, saved)
    try:
        deliver(workdir, saved.getvalue())
    except delivery.Refused as exc:
        _write_error(workdir, "tampered", exc)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
