"""The Jupyter kernel that nbgrader executes a submission in, started inside the sandbox.

``nbgrader autograde`` runs the student's whole notebook in a kernel: the kernel is student code.
The course's nbgrader config names ``JailedKernelManager``, whose command is this module: it
copies the connection file into a fresh work directory owned by the sandboxed uid and starts
``ipykernel`` with only the student copy of the package on its path: forked warm by the grading
process's kernel server where the pipeline gave nbgrader one (``prefork.kernel_relay``), under
this process's limits and in its jail, else through ``bwrap.command``; the sandbox is the same.
The kernel shares nbgrader's network namespace (nbgrader talks to it over loopback; the pipeline
runs nbgrader itself in a private one) and sees nothing else of the machine.

    python -m autograder.engine.kernel_jail CONNECTION_FILE
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from jupyter_client.manager import AsyncKernelManager

from autograder.engine import bwrap, inductor_headers, prefork
from autograder.engine.jail import Jail

# Set by the pipeline for the nbgrader process; the kernel manager passes them on.
STUDENT_PACKAGE_VAR = "FASTDL_STUDENT_PACKAGE"
GPU_VAR = "FASTDL_GPU"
UNSAFE_VAR = "FASTDL_UNSAFE_NO_ISOLATION"
# fastdl_lab.device.QUICK_VAR, named again here because importing the package would import torch
# into this launcher: the labs' ungraded experiments at tiny sizes, passed on to the kernel.
QUICK_VAR = "FASTDL_QUICK"
# A notebook's first torch.compile on the CPU has inductor compile and load a test program for each
# vector instruction set the CPU lists (about 6 s on the 2-core machines), every time: the kernel's
# compiler cache is private and starts empty. The kernel takes the CPU's list as it is instead.
INDUCTOR_TRUSTS_CPU_FLAGS = {"TORCHINDUCTOR_VEC_ISA_OK": "1"}


class JailedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernels start in the sandbox (unless grading runs unisolated)."""

    def format_kernel_cmd(self, extra_arguments=None):
        if os.environ.get(UNSAFE_VAR) == "1":
            return super().format_kernel_cmd(extra_arguments)
        return [sys.executable, "-m", "autograder.engine.kernel_jail", self.connection_file]


def headers_for_kernels(gpu: bool) -> dict[str, str]:
    """What nbgrader's environment needs for its kernels to find inductor's precompiled header
    (``inductor_headers``), made here on this machine's first call: {} where it cannot be made."""
    folder = inductor_headers.ensure(kernel_env(gpu), gpu)
    return {inductor_headers.FOLDER_VAR: str(folder)} if folder else {}


def kernel_env(gpu: bool, nbgrader_env: dict[str, str] | None = None) -> dict[str, str]:
    """The kernel's environment, made from nbgrader's (this process's, unless given)."""
    job = bwrap.JOB
    outer = os.environ if nbgrader_env is None else nbgrader_env
    passed_on = {QUICK_VAR: outer[QUICK_VAR]} if QUICK_VAR in outer else {}
    return bwrap.environment(gpu=gpu, PYTHONPATH=bwrap.STUDENT_DIR, MPLBACKEND=outer.get("MPLBACKEND", "Agg"),
                             IPYTHONDIR=f"{job}/.ipython", JUPYTER_RUNTIME_DIR=f"{job}/.jupyter",
                             MPLCONFIGDIR=f"{job}/.matplotlib", OMP_NUM_THREADS=outer.get("OMP_NUM_THREADS", "2"),
                             **INDUCTOR_TRUSTS_CPU_FLAGS, **passed_on)


def _forward(proc):
    """Interrupts reach the kernel, which sits below the sandbox's monitor and init (bubblewrap's
    two processes, or a forked sandbox's) in a session of its own."""
    from autograder.engine.sandbox import children, descendants

    def handler(signum, _frame):
        helpers = {proc.pid, *children(proc.pid)}  # the monitor, and the init below it
        for pid in descendants(proc.pid):
            if pid not in helpers:
                try:
                    os.kill(pid, signum)
                except OSError:
                    pass
    return handler


def _warm_kernel(argv: list[str], view: bwrap.View, env: dict[str, str]):
    """A kernel forked by the grading process's warm server (``prefork.kernel_relay``), under
    this process's limits and in its jail, or None: the kernel then starts through bubblewrap."""
    relay = os.environ.get(prefork.KERNEL_RELAY_VAR)
    if not relay or view.gpu:
        return None
    import resource

    rlimits = {name: resource.getrlimit(getattr(resource, name)) for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_CORE")}
    jail = Jail.of_this_process()
    try:
        return prefork.request_kernel(relay, argv, view=view, env=env, rlimits=rlimits,
                                      jail=jail.procs_files if jail else None)
    except prefork.Unavailable:
        return None


def main(connection_file: str) -> int:
    from autograder.engine.sandbox import die_with_parent

    die_with_parent()  # nbgrader gone, kernel gone (bubblewrap dies with this process in turn)
    package = os.environ.get(STUDENT_PACKAGE_VAR)
    if not package or not Path(package).is_dir():
        print(f"kernel_jail: {STUDENT_PACKAGE_VAR} must name the student copy of the package", file=sys.stderr)
        return 2
    gpu = os.environ.get(GPU_VAR) == "1"
    work = tempfile.mkdtemp(prefix="fastdl-kernel-")
    try:
        shutil.copy(connection_file, os.path.join(work, "kernel.json"))
        if os.geteuid() == 0:
            os.chown(os.path.join(work, "kernel.json"), bwrap.NOBODY, bwrap.NOBODY)
        bwrap.prepare_workdir(work)
        view = bwrap.View(work, read_only={package: bwrap.STUDENT_DIR}, network=True, gpu=gpu,
                          job_bytes=bwrap.JOB_BYTES)
        headers = os.environ.get(inductor_headers.FOLDER_VAR)
        shown = inductor_headers.view(Path(headers)) if headers else None
        if shown:
            inside, files = shown
            view.tmp_dirs = (inside,)
            view.read_only.update(files)
        argv = [bwrap.PYTHON, "-m", "ipykernel_launcher", "-f", f"{bwrap.JOB}/{view.job_in}/kernel.json"]
        proc = _warm_kernel(argv, view, kernel_env(gpu)) or subprocess.Popen(
            bwrap.command(argv, view), env=kernel_env(gpu), stdin=subprocess.DEVNULL)
        signal.signal(signal.SIGINT, _forward(proc))
        signal.signal(signal.SIGTERM, lambda *_: proc.kill())
        return proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
