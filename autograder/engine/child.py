"""Entry point of a sandboxed grading child: ``python -m autograder.engine.child WORKDIR``.

The parent wrote ``job.json``, ``inputs.pt`` and one file per student cell into WORKDIR. This
process executes the lab preamble and the cells (from real files, so ``inspect.getsource`` works
for ``@triton.jit``), then either runs the item's ``drive`` once and saves ``outputs.pt``
(mode "check"), or serves timing requests on a control pipe (mode "serve").

Everything this process says is untrusted once student code has run: the parent verifies
outputs against its own references and measures time itself.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _exec_cells(job: dict, workdir: str) -> dict:
    ns: dict = {"__name__": "__main__"}
    exec(compile(job["preamble"], os.path.join(workdir, "preamble.py"), "exec"), ns)
    for cell in job["cells"]:
        path = os.path.join(workdir, cell["file"])
        with open(path) as f:
            source = f.read()
        exec(compile(source, path, "exec"), ns)
    return ns


def _serve(call, control_fd: int, reply_fd: int) -> object:
    """Run ``call`` once per request byte; answer after the device is idle again."""
    from fastdl_lab import device

    sync = device.synchronize  # bound before the first request, like the call itself
    result = None
    with os.fdopen(control_fd, "rb", buffering=0) as control, os.fdopen(reply_fd, "wb", buffering=0) as reply:
        reply.write(b"r")  # ready: set-up (imports, compilation of the student's cells) is done
        while control.read(1) == b"c":
            result = call()
            sync()
            reply.write(b"d")
    return result


def main(workdir: str) -> int:
    with open(os.path.join(workdir, "job.json")) as f:
        job = json.load(f)
    import torch

    from autograder.engine.items import load_lab

    item = load_lab(job["lab"]).item(job["item"])
    inputs = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=True)
    try:
        ns = _exec_cells(job, workdir) if job["role"] == "candidate" else {}
        if job["mode"] == "check":
            outputs = item.drive(ns, inputs)
        else:
            call = item.timed(ns, inputs) if job["role"] == "candidate" else item.baseline(inputs)
            outputs = _serve(call, job["control_fd"], job["reply_fd"])
    except BaseException as exc:  # noqa: BLE001 - every failure of student code is reported
        summary = f"{type(exc).__name__}: {exc}"[:2000]
        with open(os.path.join(workdir, "error.json"), "w") as f:
            json.dump({"error": summary, "traceback": traceback.format_exc()[-4000:]}, f)
        print(summary, file=sys.stderr)
        return 3
    torch.save(outputs, os.path.join(workdir, "outputs.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
