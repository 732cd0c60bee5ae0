"""What hardware is here: device facts, datasheet peaks, the measured roofline (lab 00).

Importing this module switches Triton to its interpreter when no GPU is present, so
``from fastdl_lab import device`` before the first ``@triton.jit`` is all a lab needs to run its
kernels on the CPU. This is also the only module that synchronises the device; every other module
calls :func:`synchronize` so that no ``torch.cuda`` call is ever reached on a CPU-only build.

Quick mode (``FASTDL_QUICK=1``, read through :func:`quick`) is the one switch for the size of the
labs' *ungraded* experiments: sweeps, plots, benchmarks and demonstrations in a notebook. The
grader turns it on for nbgrader's execution of every submission and the tests turn it on for the
notebooks they run, because there those cells only have to run, not to teach: their figures go
nowhere. Rules for a lab:

- ask once, in the setup cell beside ``GPU``: ``QUICK = device.quick()``; then an experiment cell
  picks its sizes, ``sizes = [64, 256] if QUICK else [64, 256, 1024, 4096]``, keeping at least two
  points of a curve and every key or label that later cells read;
- never in a graded cell, a hidden test, or code the grader or the package runs: what a test cell
  checks, and every input the engine draws, is the same in both modes;
- package functions take sizes as arguments and never read the switch, so a lab's quick sizes are
  visible in the lab itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass

import torch

_TRUTHY = {"1", "true", "on", "yes"}


def has_gpu() -> bool:
    # Some broken CUDA installs raise instead of answering False; treat them as no GPU.
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def enable_interpreter_if_no_gpu() -> bool:
    """Switch Triton to its interpreter when there is no GPU; under the interpreter, kernels run
    checked (``fastdl_lab.bounds``): an out-of-bounds access raises instead of killing the process."""
    if not has_gpu():
        # setdefault: a user who exported TRITON_INTERPRET=0 on purpose keeps their choice.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if interpreting():
        from fastdl_lab import bounds

        bounds.install_when_interpreting()
    return interpreting()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY


enable_interpreter_if_no_gpu()


def capability(t: torch.Tensor | None = None) -> int | None:
    """The NVIDIA compute capability a kernel launch on ``t`` compiles for, as ``10 * major + minor``
    (80 for an A100, 90 for an H100), or None when kernels run under the interpreter on the CPU.

    This is the one key every kernel module's ``default_config(..., capability)`` picks its launch
    configuration by, so the configuration a launcher uses and the one the compiled-artefact checks
    compile for sm_80 / sm_90 come from the same function.
    """
    if interpreting() or (t is not None and not t.is_cuda) or not has_gpu():
        return None
    major, minor = torch.cuda.get_device_capability(t.device if t is not None else None)
    return 10 * major + minor


# Triton's names for the floating types its kernels in this course take (PTX signatures use them).
TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def check_kernel_tensor(t: torch.Tensor, name: str = "tensors") -> None:
    """The dtype and device gate every Triton launcher of the course applies to its inputs.

    Under the interpreter bf16 is refused: ``tl.dot`` multiplies raw bit patterns there and NumPy
    has no bfloat16, so a bf16 result on the CPU would prove nothing.
    """
    if t.dtype not in TRITON_TYPES:
        raise ValueError(f"dtype {t.dtype} not supported; use float16, float32 or (on a GPU) bfloat16")
    if interpreting():
        if t.dtype == torch.bfloat16:
            raise ValueError("bfloat16 is wrong or unchecked under the Triton interpreter (tl.dot multiplies "
                             "raw bit patterns); use float16 or float32 on the CPU, bfloat16 on a GPU")
        if t.is_cuda:
            raise ValueError("the Triton interpreter is on, so the kernels run on the CPU: pass CPU tensors")
    elif not t.is_cuda:
        raise ValueError(f"{name} on {t.device}, but Triton compiles for the GPU: move them to 'cuda'")


QUICK_VAR = "FASTDL_QUICK"


def quick() -> bool:
    """True when ``FASTDL_QUICK`` asks the labs to run their ungraded experiments at tiny sizes."""
    return os.environ.get(QUICK_VAR, "").strip().lower() in _TRUTHY


def synchronize() -> None:
    if has_gpu():
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------
# Device facts


@dataclass
class DeviceInfo:
    kind: str
    name: str
    sm_count: int | None
    memory_bytes: int
    cpu_count: int
    torch_version: str
    triton_version: str | None
    cuda_version: str | None
    driver: str | None
    capability: tuple[int, int] | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _package_version(name: str) -> str | None:
    # Read from metadata: importing triton here would make every `import fastdl_lab.device` heavy.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_count() -> int:
    # The affinity mask is what a container or a grader's CPU limit actually grants us.
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _driver_version() -> str | None:
    # torch exposes the CUDA API version but not the kernel driver's, which is what a record needs.
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


@functools.cache
def info() -> DeviceInfo:
    common = dict(
        cpu_count=_cpu_count(),
        torch_version=torch.__version__,
        triton_version=_package_version("triton"),
        cuda_version=torch.version.cuda,
    )
    if not has_gpu():
        return DeviceInfo(kind="cpu", name=_cpu_name(), sm_count=None,
                          memory_bytes=_host_memory_bytes(), driver=None, capability=None,
                          **common)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return DeviceInfo(kind="cuda", name=props.name, sm_count=props.multi_processor_count,
                      memory_bytes=props.total_memory, driver=_driver_version(),
                      capability=(props.major, props.minor), **common)


# --------------------------------------------------------------------------------------------
# Datasheet peaks


@dataclass(frozen=True)
class Peak:
    """Vendor datasheet figures. Tensor-core rates are dense (the 2:4-sparsity figures are 2x)."""

    name: str
    fp32_tflops: float
    tf32_tflops: float | None
    fp16_tflops: float
    bf16_tflops: float | None
    int8_tops: float
    mem_bw_gbs: float
    memory_gb: float
    l2_mb: float
    sm_count: int


PEAKS: dict[str, Peak] = {
    "h100": Peak("H100 SXM5 80GB", fp32_tflops=67.0, tf32_tflops=494.7, fp16_tflops=989.4,
                 bf16_tflops=989.4, int8_tops=1978.9, mem_bw_gbs=3350.0, memory_gb=80.0,
                 l2_mb=50.0, sm_count=132),
    # Same GH100 compute as the H100 SXM; the difference is HBM3e capacity and bandwidth.
    "h200": Peak("H200 SXM 141GB", fp32_tflops=67.0, tf32_tflops=494.7, fp16_tflops=989.4,
                 bf16_tflops=989.4, int8_tops=1978.9, mem_bw_gbs=4800.0, memory_gb=141.0,
                 l2_mb=50.0, sm_count=132),
    "a100": Peak("A100 SXM4 80GB", fp32_tflops=19.5, tf32_tflops=156.0, fp16_tflops=312.0,
                 bf16_tflops=312.0, int8_tops=624.0, mem_bw_gbs=2039.0, memory_gb=80.0,
                 l2_mb=40.0, sm_count=108),
    "l4": Peak("L4", fp32_tflops=30.3, tf32_tflops=60.0, fp16_tflops=121.0, bf16_tflops=121.0,
               int8_tops=242.5, mem_bw_gbs=300.0, memory_gb=24.0, l2_mb=48.0, sm_count=58),
    # Turing tensor cores have neither TF32 nor bf16.
    "t4": Peak("T4", fp32_tflops=8.1, tf32_tflops=None, fp16_tflops=65.0, bf16_tflops=None,
               int8_tops=130.0, mem_bw_gbs=320.0, memory_gb=16.0, l2_mb=4.0, sm_count=40),
}

# Whole-token matches, so "GH200" is not taken for an H200 nor "RTX A1000" for an A100.
_NAME_PATTERNS = {key: re.compile(rf"(?<![A-Z0-9]){key.upper()}(?![0-9])") for key in PEAKS}


def _peak_key(name: str) -> str | None:
    upper = name.upper()
    for key, pattern in _NAME_PATTERNS.items():
        if pattern.search(upper):
            return key
    return None


def datasheet_peak(name: str | None = None) -> Peak | None:
    """Datasheet figures for a CUDA device name (the current device when None).

    PCIe and NVL variants match their family and get the SXM figures listed here, which are
    upper bounds for them.
    """
    if name is None:
        if not has_gpu():
            return None
        name = info().name
    key = _peak_key(name)
    return PEAKS[key] if key else None


_PROFILED = {"t4", "a100", "h100", "h200"}


def profile_name() -> str:
    """The grading hardware profile of this machine (``autograder/profiles/<name>.json``)."""
    if not has_gpu():
        return "cpu"
    key = _peak_key(info().name)
    return key if key in _PROFILED else "default"


# --------------------------------------------------------------------------------------------
# Roofline


@dataclass
class Roofline:
    bandwidth_gbs: float
    tflops: float
    dtype: torch.dtype
    source: str
    device: str

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte at which compute stops being limited by memory."""
        return self.tflops * 1e12 / (self.bandwidth_gbs * 1e9)

    def attainable_tflops(self, intensity: float) -> float:
        return min(self.tflops, intensity * self.bandwidth_gbs / 1e3)


_PEAK_FIELD = {torch.float32: "fp32_tflops", torch.float16: "fp16_tflops",
               torch.bfloat16: "bf16_tflops"}


def datasheet_roofline(name: str | None = None, dtype: torch.dtype = torch.float32
                       ) -> Roofline | None:
    """The roofline a datasheet promises, to set beside :func:`measure_roofline`'s."""
    peak = datasheet_peak(name)
    tflops = getattr(peak, _PEAK_FIELD.get(dtype, ""), None) if peak else None
    if tflops is None:
        return None
    return Roofline(bandwidth_gbs=peak.mem_bw_gbs, tflops=tflops, dtype=dtype,
                    source="datasheet", device=peak.name)


def measure_roofline(*, copy_bytes: int | None = None, matmul_n: int | None = None,
                     dtype: torch.dtype = torch.float32, reps: int = 5) -> Roofline:
    """Measure both roofs: a large copy for bandwidth and a large matmul for FLOP/s.

    Defaults keep the CPU run under about two seconds on two cores; on a GPU they are large
    enough that launch overhead is negligible.
    """
    from fastdl_lab import timing

    gpu = has_gpu()
    dev = "cuda" if gpu else "cpu"
    copy_bytes = copy_bytes or (1 << 30 if gpu else 64 << 20)
    matmul_n = matmul_n or (8192 if gpu else 1024)

    src = torch.empty(copy_bytes // dtype.itemsize, dtype=dtype, device=dev).fill_(1)
    dst = torch.empty_like(src)
    copy_s = timing.bench(lambda: dst.copy_(src), warmup=1, reps=reps).median
    # A copy reads every byte once and writes it once.
    moved = 2 * src.nbytes
    del src, dst  # free the copy buffers before the matmul allocates its own

    a = torch.randn(matmul_n, matmul_n, device=dev).to(dtype)
    b = torch.randn(matmul_n, matmul_n, device=dev).to(dtype)
    c = torch.empty_like(a)
    mm_s = timing.bench(lambda: torch.mm(a, b, out=c), warmup=1, reps=reps).median

    return Roofline(bandwidth_gbs=moved / copy_s / 1e9, tflops=2 * matmul_n**3 / mm_s / 1e12,
                    dtype=dtype, source="measured", device=info().name)


# --------------------------------------------------------------------------------------------
# What a GPU host lacks

# The oldest Linux driver each CUDA major version of a torch build runs on (NVIDIA's CUDA
# compatibility table: minor-version compatibility within a major version). An older driver makes
# torch report no GPU at all, so the GPU that nvidia-smi lists goes unused.
MIN_DRIVER = {11: (450, 80, 2), 12: (525, 60, 13), 13: (580, 65, 6)}


@dataclass(frozen=True)
class HostFacts:
    """What :func:`host_problems` judges, gathered by :func:`host_facts` (or made up in a test)."""

    torch_gpu: bool  # torch sees a CUDA device
    driver: str | None  # the kernel driver's version from nvidia-smi; None: no NVIDIA driver here
    torch_cuda: str | None  # the CUDA version torch was built with; None: a CPU build
    c_compiler: str | None  # what Triton would build its launcher with; None: nothing found
    triton_interpret: str | None  # TRITON_INTERPRET as set in the environment
    triton: str | None  # Triton's installed version


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


def find_c_compiler(environ: dict[str, str] | None = None) -> str | None:
    """The compiler Triton builds its launcher with on Linux: ``$CC``, else ``gcc``, else ``clang``."""
    environ = os.environ if environ is None else environ
    if environ.get("CC", "").strip():
        return shutil.which(environ["CC"].split()[0])
    return shutil.which("gcc") or shutil.which("clang")


def host_problems(facts: HostFacts) -> list[str]:
    """What keeps compiled Triton kernels from running on this host, one sentence each with the fix.

    Empty on a CPU-only machine without an NVIDIA driver: there the interpreter is the plan
    (:func:`interpreter_problem` says whether it can run the kernels).
    """
    problems = []
    if facts.driver and not facts.torch_gpu:
        if facts.torch_cuda is None:
            problems.append(f"an NVIDIA driver ({facts.driver}) is here but torch is a CPU build: install a "
                            "CUDA build of torch")
        else:
            major = _version_tuple(facts.torch_cuda)[0]
            needed = MIN_DRIVER.get(major)
            if needed and _version_tuple(facts.driver) < needed:
                problems.append(f"driver {facts.driver} is too old for torch built with CUDA {facts.torch_cuda} "
                                f"(needs {'.'.join(map(str, needed))} or newer): update the driver or install "
                                "a torch built for an older CUDA")
            else:
                problems.append(f"an NVIDIA driver ({facts.driver}) is here but torch sees no GPU: check "
                                "CUDA_VISIBLE_DEVICES and that /dev/nvidia* is readable")
    if not facts.torch_gpu:
        return problems
    if (facts.triton_interpret or "").strip().lower() in _TRUTHY:
        problems.append(f"TRITON_INTERPRET={facts.triton_interpret} although a GPU is present: every launcher "
                        "runs on the CPU and refuses CUDA tensors; unset it")
    if facts.triton is None:
        problems.append("Triton is not installed: the course's kernels cannot compile")
    elif facts.c_compiler is None:
        problems.append("no C compiler (CC, gcc or clang): Triton builds its launcher with one the first time "
                        "a kernel runs; 'apt-get install gcc', or 'conda install gcc' in the conda environment")
    return problems


def host_facts() -> HostFacts:
    gpu = has_gpu()
    return HostFacts(torch_gpu=gpu, driver=info().driver if gpu else _driver_version(),
                     torch_cuda=torch.version.cuda, c_compiler=find_c_compiler(),
                     triton_interpret=os.environ.get("TRITON_INTERPRET"), triton=_package_version("triton"))


class InterpreterBroken(RuntimeError):
    """Triton's interpreter cannot run the course's kernels on this host; the message says why."""


# Triton 3.6's interpreter hands a loop bound passed as an argument to ``range`` as a one-element
# array and converts it with ``int()``, which NumPy 2.4 refuses for arrays that are not
# 0-dimensional: every kernel with such a loop fails there (triton-lang/triton#9171, fixed in 3.7).
_INTERPRETER_FIX = "install 'numpy<2.4' or Triton 3.7 or newer (triton-lang/triton#9171)"


def known_interpreter_problem(triton: str | None, numpy: str | None) -> str | None:
    """The sentence for a Triton and NumPy known not to run the course's kernels under the
    interpreter, judged from their versions alone (``describe`` imports no Triton)."""
    if triton and numpy and _version_tuple(triton)[:2] < (3, 7) and _version_tuple(numpy)[:2] >= (2, 4):
        return (f"Triton {triton} with NumPy {numpy}: Triton's interpreter, which runs the kernels on a CPU, "
                f"fails on every loop whose bound is an argument; {_INTERPRETER_FIX}")
    return None


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the course's kernels on this host (one sentence with the
    fix), or None where it can or where Triton is missing (a problem of its own).

    Found by running a kernel (``fastdl_lab.interpreter_probe``), which imports Triton."""
    try:
        from fastdl_lab import interpreter_probe
    except ImportError:
        return None
    versions = f"Triton {_package_version('triton')} with NumPy {_package_version('numpy')}"
    try:
        got = interpreter_probe.run()
    except Exception as exc:  # noqa: BLE001 - whatever the interpreter raises is the answer
        return (f"{versions}: Triton's interpreter, which runs the kernels on a CPU, fails on a loop whose "
                f"bound is an argument ({type(exc).__name__}: {str(exc)[:160]}); {_INTERPRETER_FIX}")
    if got != [0, 1, 2]:
        return f"{versions}: Triton's interpreter computes {got} for [0, 1, 2]: install the course's pinned Triton"
    return None


def check_interpreter() -> None:
    """Raise :class:`InterpreterBroken` where Triton's interpreter cannot run the course's kernels
    (found by running one)."""
    problem = interpreter_problem()
    if problem:
        raise InterpreterBroken(problem)


# --------------------------------------------------------------------------------------------
# Summary


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def describe() -> str:
    """A short summary of this machine for the first cell of every lab."""
    d = info()
    if d.kind == "cuda":
        major, minor = d.capability
        lines = [f"device    {d.name} ({d.sm_count} SMs, compute capability {major}.{minor})",
                 f"memory    {_gib(d.memory_bytes)} on the GPU; host has {d.cpu_count} cores"]
    else:
        lines = [f"device    CPU only: {d.name} ({d.cpu_count} cores)",
                 f"memory    {_gib(d.memory_bytes)}"]
    versions = f"torch {d.torch_version}, triton {d.triton_version or 'not installed'}"
    if d.cuda_version:
        versions += f", CUDA {d.cuda_version}"
    if d.driver:
        versions += f", driver {d.driver}"
    lines.append(f"versions  {versions}")
    lines.append("triton    " + ("interpreter ON: kernels run on the CPU, correct but slow"
                               if interpreting() else "compiled kernels on the GPU"))
    peak = datasheet_peak() if d.kind == "cuda" else None
    if peak:
        lines.append(f"datasheet {peak.name}: {peak.fp32_tflops:g} TFLOP/s fp32, "
                     f"{peak.fp16_tflops:g} TFLOP/s fp16 tensor cores, {peak.mem_bw_gbs:g} GB/s")
    elif d.kind == "cuda":
        lines.append("datasheet no peak figures known for this GPU")
    lines.append(f"profile   {profile_name()}")
    problems = host_problems(host_facts())
    if interpreting():
        problems.append(known_interpreter_problem(_package_version("triton"), _package_version("numpy")))
    lines += [f"MISSING   {problem}" for problem in problems if problem]
    return "\n".join(lines)
