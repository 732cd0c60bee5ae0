"""Entry point of a sandboxed grading child: ``python -m autograder.engine.child /job/in``.

The grader made ``/job/in`` (read-only here): ``job.json``, ``inputs.wire`` (the item's inputs in the
data-only format, less what the item withholds), the channel's socket (``channel.py``) and either

- ``kernels.py``: the student's ``@triton.jit`` functions and constants, extracted by the grader
  (``kernels.py`` of the engine). No other student code exists in this process. Under the Triton
  interpreter each kernel is compiled ahead of time for sm_90 before its first launch, which
  proves its body is Triton and not Python in disguise; or
- ``artefacts.py``: the student's classes and functions, screened and extracted by the grader
  (``artefacts.py`` of the engine), run in the names the item's trusted ``scope`` imports, with
  or without kernels beside them; or
- one file per solution cell, executed after the lab preamble.

In a *reference* child (``job["reference"]``) none of these exist: the item's ``reference``
builds the namespace from the course's own code, and the child is trusted. Nor in a *build* child
(mode "build", ``Item.built``): it runs the item's build on the source the grader read from the
cells (a compiler, never what it makes) and sends what was made. The student's child of such an
item finds the grader's copy of the approved files in ``/job/in/built``, and nothing else of the
student's.

The runner connects to the grader before any student code exists, then runs the item's ``drive``
once and sends its outputs (mode "check", or mode "rank": one rank of each of its worlds, joined
to the grader's relay first, ``_take_seats``); times a kernel item's candidate against its baseline
with ``fastdl_lab.timing.compare`` and marks the timed phase for the grader's clock (mode "speed");
or answers the grader's calls one by one, each timed by the grader (mode "session").

**Once student code is loaded, nothing here is trusted.** The grader takes what comes back as data
and checks it: values against references it computes itself, figures against what it measured
from outside (the cgroup's memory peak, its own clock, the traffic of its services). The
instruments an item names (bound before the cells run, verified after) and the artefact screen
are a second line that names a crude tampering, never what a grade rests on. Only a kernel item,
where no student Python exists, is timed in this process.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from autograder.engine import faults

ERROR_CHARS = 2000
INPUTS = "inputs.wire"
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


def _namespace(job: dict, jobdir: str, library: str) -> dict:
    if job.get("built") is not None:
        # What the grader built from the student's source and approved: nothing of it is loaded
        # until the item's drive loads it.
        return {name: os.path.join(jobdir, path) for name, path in job["built"].items()}
    if job.get("kernel_module") or job.get("artefact_module"):
        ns: dict = {"__name__": "student_kernels"}
        if job.get("kernel_module"):
            _exec_file(os.path.join(jobdir, job["kernel_module"]), ns)
            from fastdl_lab import device

            if device.interpreting():
                _prove_kernels_compile(ns)
        if job.get("artefact_module"):
            return _artefact_namespace(job, jobdir, kernels=ns, library=library)
        return ns
    ns = {"__name__": "__main__"}
    exec(compile(job["preamble"], os.path.join(jobdir, "preamble.py"), "exec"), ns)
    for cell in job["cells"]:
        _exec_file(os.path.join(jobdir, cell["file"]), ns)
    return ns


def _artefact_namespace(job: dict, jobdir: str, kernels: dict, library: str) -> dict:
    """The student's screened classes and functions, in a namespace of their own: the scope's
    names, the kernels and constants, the safe builtins and the guard every attribute read goes
    through (``reach.py``). Kernels keep their own globals (with Python's builtins, which Triton's
    compiler and interpreter need)."""
    from types import ModuleType

    from autograder.engine import reach

    ns: dict = {"__name__": "student_artefacts"}
    exec(compile(job["scope"], os.path.join(jobdir, "scope.py"), "exec"), ns)
    scope_modules = frozenset(value.__name__ for value in ns.values() if isinstance(value, ModuleType))
    ns.update({name: value for name, value in kernels.items() if not name.startswith("__")})
    # Functions capture the builtins of the namespace they are defined in.
    ns["__builtins__"] = reach.extracted_builtins(scope_modules)
    reach.refuse_unpickling(library)
    _exec_file(os.path.join(jobdir, job["artefact_module"]), ns)
    return ns


def _speed_instruments() -> tuple[str, ...]:
    from fastdl_lab import timing

    return tuple(f"fastdl_lab.timing.{name}" for name in TIMING_FUNCTIONS) + timing.INSTRUMENTS


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


def _job_file(jobdir: str, name: str) -> str:
    return os.path.join(jobdir, name)


def _reference_namespace(item, inputs: dict) -> dict:
    """A trusted child: the course's own implementation under the names the student's would have."""
    if item.reference is None:
        raise RuntimeError(f"item {item.name} has no reference implementation to run")
    return item.reference(inputs)


def _serve(item, ns: dict, inputs: dict, link, reference: bool) -> None:
    """Mode "session": answer the grader's calls until it says it is done. Each call's inputs arrive
    with it (the grader made them and the child has not seen them), and the grader times the call
    from its request to this result."""
    from fastdl_lab import device

    clocked = item.clocked
    run = (clocked.baseline if reference else clocked.candidate)(ns, inputs)
    while True:
        request = link.next_request()
        if request is None:
            return
        number = request.get("id")
        try:
            value = run(request.get("args", {}))
            device.synchronize()
            link.send("result", id=number, value=value)
        except Exception as exc:  # noqa: BLE001 - the call's failure is the grader's to judge
            link.send("result", id=number, error=f"{type(exc).__name__}: {exc}"[:ERROR_CHARS])


def _take_seats(item, job: dict, jobdir: str, seats: list[dict], reference: bool) -> list:
    """Mode "rank": this child is one rank of each world in ``seats``, one world after another
    (``engine/worlds.py``). It joins each through that world's relay socket in its job folder, the
    only way out of its sandbox; the first before any student code exists. The socket is its rank
    to the relay, whatever this process says: every collective and message of the drive goes
    through the relay, which logs it in the grader's process. The drive's outputs in every world
    are delivered together."""
    import torch.distributed as dist

    from autograder.engine import relay_backend

    _memory_returned_on_free()
    outputs, ns = [], None
    for seat in seats:
        name = str(seat["socket"])
        if os.path.basename(name) != name:
            raise ValueError(f"a relay socket is a name in the job folder, not {name!r}")
        relay_backend.init_relay_world(_job_file(jobdir, name), int(seat["rank"]), int(seat["world_size"]),
                                       float(seat["timeout_s"]))
        if ns is None:
            ns = _reference_namespace(item, seat) if reference else _namespace(job, jobdir, item.library)
        outputs.append(item.drive(ns, seat))
        dist.destroy_process_group()  # leaves the world: the relay sees this rank go
    return outputs


# glibc's mallopt parameter: allocations from this many bytes are mapped on their own and unmapped
# when freed (and the threshold no longer moves up after a free, as it does by default).
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 10


def _memory_returned_on_free(threshold: int = MMAP_THRESHOLD_BYTES) -> None:
    """A rank's memory peak is a figure the grader reads (its cgroup's): large tensors go back to
    the system when freed, rather than to whichever thread's heap freed them, so that the peak is
    what the rank held at once, within a few MiB from run to run, not what its heaps kept. The
    memory items of labs 02 and 05 call it from their drives (``labs/_common.exact_peaks``)."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, int(threshold))
    except (OSError, AttributeError):
        pass  # not glibc: the peak is noisier, and the margins still apply


def _report(link, status: str, exc: BaseException) -> None:
    summary = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
    print(summary, file=sys.stderr)
    try:
        link.send("error", status=status, error=summary)
    except OSError:
        pass


def main(jobdir: str) -> int:
    from autograder.engine import channel

    link = channel.Link(_job_file(jobdir, channel.SOCKET))  # before any student code exists here
    channel.child_link = link
    with open(_job_file(jobdir, "job.json")) as f:
        job = json.load(f)
    from autograder import wire
    from autograder.engine.items import lab_spec

    item = lab_spec(job["lab"]).item(job["item"])
    inputs = wire.load(_job_file(jobdir, INPUTS), cap=1 << 40)
    mode, reference = job["mode"], bool(job.get("reference"))
    if mode == "speed":
        from fastdl_lab import timing

        compare = timing.compare

        def announce(phase: str) -> None:
            link.send("mark", phase=phase)
    if job.get("triton_key"):
        _reuse_triton_key(job["triton_key"])
    instruments = _Instruments(tuple(job.get("instruments", ())) + (_speed_instruments() if mode == "speed" else ()))
    try:
        if mode == "build":
            # A build child: no code of the student's is loaded here, and nothing it builds.
            outputs = item.built.build(inputs["source"], job["params"])
        elif mode == "rank":
            outputs = _take_seats(item, job, jobdir, inputs["seats"], reference)
        else:
            ns = _reference_namespace(item, inputs) if reference else _namespace(job, jobdir, item.library)
            if mode == "speed":
                instruments.verify()  # before the clock starts: a patched clock never times anything
                outputs = _timed(item, ns, inputs, job["params"], compare, announce)
            elif mode == "session":
                _serve(item, ns, inputs, link, reference)
                outputs = None
            else:
                outputs = item.drive(ns, inputs)
        instruments.verify()
    except Tampered as exc:
        _report(link, "tampered", exc)
        return 3
    except KernelNotCompiled as exc:
        _report(link, "not_a_kernel", exc)
        return 3
    except BaseException as exc:  # noqa: BLE001 - every failure of student code is reported
        # A replaced instrument often breaks the run it was replaced for: name the cause.
        try:
            instruments.verify()
        except Tampered as tampered:
            _report(link, "tampered", tampered)
            return 3
        _report(link, faults.child_status(exc), exc)
        return 3
    try:
        link.send("outputs", value=outputs)
    except wire.WireError as exc:
        _report(link, "error", RuntimeError(f"the outputs are not data the grader reads: {exc}"))
        return 3
    if mode == "rank":
        _leave()
    return 0


def _leave() -> None:
    """A rank's child ends as soon as its outputs are delivered: a world waits for its slowest
    rank, and the interpreter's exit functions (torch's registered libraries, each reset in turn)
    take a tenth of a second on 2 cores, for nothing the grader reads."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
