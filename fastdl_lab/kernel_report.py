"""What every kernel of the course compiles to on an A100 and an H100, at the configs its launchers pick.

A kernel that is correct under the interpreter can still be slow on a GPU for reasons the compiler
states plainly: registers spilled to local memory, more shared memory than an SM gives one block
(the launch fails), or 16-bit dots that missed the tensor cores. None of this needs a GPU to see:
each kernel module's ``compiled(capability, ...)`` builds the kernel at exactly the configuration its
launcher chooses on that GPU (``default_config(..., capability)``), and this module reads the result
with the tools Triton ships (``ptxas -v`` for spills, ``cuobjdump`` for registers and the machine
code). ``benchmarks/kernels.py`` writes the rows to ``benchmarks/results/kernels_sm80.csv`` and
``kernels_sm90.csv``; ``tests/test_kernel_report.py`` asserts them.

    >>> from fastdl_lab import kernel_report
    >>> for row in kernel_report.rows(90):
    ...     print(row["kernel"], row["registers"], row["spill_bytes"], row["loop_instructions"])
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from fastdl_lab import triton_aot

import triton

# Shared memory one block may opt into (bytes), from NVIDIA's CUDA C programming guide tables.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
TARGETS = (80, 90)
COLUMNS = ("kernel", "shape", "config", "target", "triton", "registers", "spill_bytes", "local_stack_bytes",
           "shared_bytes", "shared_limit", "tensor_core", "loop_instructions")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel at one of the shapes the course launches it on.

    ``build(capability)`` returns Triton's compiled kernel at the launcher's configuration for that
    GPU; ``tensor_core`` names the instruction family its dots must reach there (``"wgmma"``,
    ``"mma"``), or is None for a kernel without a 16-bit or 8-bit dot.
    """

    kernel: str
    shape: str
    build: Callable[[int], object]
    tensor_core: Callable[[int], str] | None = None


def dot_path(capability: int) -> str:
    # Hopper's warpgroup MMA is the fast path on sm_90; everything before it has mma.sync only.
    return "wgmma" if capability >= 90 else "mma"


def launches() -> list[Launch]:
    """Every kernel of the course at the shapes its lab and benchmark launch it on."""
    from fastdl_lab import attention, gemm, layernorm, optim, rowsum, softmax
    from fastdl_lab.quant import w8a8

    f16 = torch.float16

    def gemm_config(index: int):
        # Each autotune candidate of the arch; an arch with fewer candidates has no such launch.
        def build(capability: int):
            configs = gemm.autotune_configs(capability)
            return gemm.compiled(capability, f16, config=configs[index]) if index < len(configs) else None
        return build

    out = [Launch("gemm", f"fp16 4096x4096x4096, autotune config {i}", gemm_config(i), dot_path)
           for i in range(max(len(gemm.autotune_configs(c)) for c in TARGETS))]
    out.append(Launch("gemm", "fp16 4096x4096x4000 (ragged K)",
                      lambda cap: gemm.compiled(cap, f16, even_k=False), dot_path))
    for n_cols in (1000, 8192, 32768):
        out.append(Launch("softmax", f"fp16 rows of {n_cols}",
                          lambda cap, n=n_cols: softmax.compiled(cap, f16, n_cols=n)))
    for which in ("fwd", "bwd_dx", "bwd_dwdb"):
        out.append(Launch(f"layernorm.{which}", "fp16 4096 rows of 4096",
                          lambda cap, w=which: layernorm.compiled(cap, f16, n_cols=4096, n_rows=4096, which=w)))
    for causal, even_n in ((True, True), (False, True), (True, False)):
        shape = f"fp16 d=64 {'causal' if causal else 'full'}" + ("" if even_n else ", ragged N")
        for which in ("fwd", "bwd_preprocess", "bwd_dkdv", "bwd_dq"):
            out.append(Launch(f"attention.{which}", shape,
                              lambda cap, w=which, c=causal, e=even_n: attention.compiled(
                                  cap, f16, which=w, head_dim=64, causal=c, even_n=e),
                              None if which == "bwd_preprocess" else dot_path))
    out.append(Launch("attention.fwd", "fp16 d=128 causal",
                      lambda cap: attention.compiled(cap, f16, which="fwd", head_dim=128), dot_path))
    out.append(Launch("rowsum", "fp32 rows", lambda cap: rowsum.compiled(cap, torch.float32)))
    out.append(Launch("optim.adamw", "fp32 params, fp32 master", lambda cap: optim.compiled(cap, has_master=True)))
    out.append(Launch("quant.int8_matmul", "int8 x int8", lambda cap: w8a8.compiled(cap), dot_path))
    return out


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=True, timeout=120)


def spill_bytes(compiled) -> int:
    """Bytes of registers spilled (stores plus loads), from ``ptxas -v`` on the kernel's own PTX with
    the options Triton's compiler passes."""
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    capability = int(compiled.metadata.target.arch)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(compiled.asm["ptx"])
        report = _run([triton_aot.nvidia_tool("ptxas"), "-lineinfo", "-v", "--regAllocOptLevel=2",
                       f"--gpu-name={sm_arch_from_capability(capability)}", str(source),
                       "-o", str(Path(tmp) / "kernel.cubin")]).stderr
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if not found:
        raise RuntimeError(f"ptxas -v printed no spill figures: {report.strip()[:300]}")
    return sum(int(stores) + int(loads) for stores, loads in found)


def sass(compiled) -> str:
    """The machine code (SASS) of a compiled kernel, as ``cuobjdump -sass`` prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return _run([triton_aot.nvidia_tool("cuobjdump"), "-sass", str(cubin)]).stdout


# "/*2280*/   @P5 BRA 0x1b40 ;": the address of the branch, an optional predicate, the target.
_BRANCH = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w*\s+)?BRA\S*\s+0x([0-9a-f]+)")
INSTRUCTION_BYTES = 16  # every SASS instruction since Volta is 128 bits


def loop_instructions(listing: str) -> list[int]:
    """Instructions in each innermost loop body of a SASS listing, in address order.

    A loop is a backward branch; its body runs from the branch's target to the branch. Loops that
    contain another loop are left out (their count would include the inner body), and so is the
    one-instruction branch-to-self Triton's kernels end with.
    """
    loops = []
    for match in _BRANCH.finditer(listing):
        at, target = int(match.group(1), 16), int(match.group(2), 16)
        if target < at:
            loops.append((target, at))
    innermost = [(lo, hi) for lo, hi in loops
                 if not any((lo, hi) != (a, b) and lo <= a and b <= hi for a, b in loops)]
    return [(hi - lo) // INSTRUCTION_BYTES + 1 for lo, hi in sorted(innermost)]


def tensor_core_family(ptx: str) -> str:
    summary = triton_aot.ptx_summary(ptx)
    if summary["wgmma"]:
        return "wgmma"
    return "mma" if summary["mma"] else "none"


def config_text(compiled) -> str:
    """The launch configuration a compiled kernel was built with: its constexpr tile sizes and
    flags, warps and stages."""
    names = list(compiled.src.signature)
    constants = {names[key[0]]: value for key, value in compiled.src.constants.items()
                 if len(key) == 1 and names[key[0]].isupper()}
    parts = [f"{name}={value}" for name, value in constants.items()]
    parts += [f"warps={compiled.metadata.num_warps}", f"stages={compiled.metadata.num_stages}"]
    return " ".join(parts)


def row(launch: Launch, capability: int) -> dict | None:
    """The compiled facts of one launch on one GPU; None when the kernel has no such launch there."""
    compiled = launch.build(capability)
    if compiled is None:
        return None
    used = triton_aot.resources(compiled)
    return {
        "kernel": launch.kernel,
        "shape": launch.shape,
        "config": config_text(compiled),
        "target": f"sm_{capability}",
        "triton": triton.__version__,
        "registers": used["registers"],
        "spill_bytes": spill_bytes(compiled),
        "local_stack_bytes": used["local_bytes"] + used["stack_bytes"],
        "shared_bytes": used["shared_bytes"],
        "shared_limit": SHARED_LIMIT[capability],
        "tensor_core": tensor_core_family(compiled.asm["ptx"]),
        "loop_instructions": ";".join(str(n) for n in loop_instructions(sass(compiled))),
    }


def problems(found: dict) -> list[str]:
    """What keeps one compiled launch (a row) from running well on its GPU, in words; empty when nothing."""
    capability = int(found["target"].removeprefix("sm_"))
    launch = next(launch for launch in launches() if (launch.kernel, launch.shape) == (found["kernel"], found["shape"]))
    name = f"{found['kernel']} ({found['shape']}) on sm_{capability}"
    out = []
    if found["spill_bytes"] or found["local_stack_bytes"]:
        out.append(f"{name} spills registers: {found['spill_bytes']} bytes spilled, "
                   f"{found['local_stack_bytes']} bytes of local memory and stack per thread")
    if found["shared_bytes"] > found["shared_limit"]:
        out.append(f"{name} needs {found['shared_bytes']} bytes of shared memory; a block may have "
                   f"{found['shared_limit']}: the launch would fail")
    expected = launch.tensor_core(capability) if launch.tensor_core else None
    if expected is not None and found["tensor_core"] != expected:
        out.append(f"{name} should reach the tensor cores through {expected}, but compiles to "
                   f"{found['tensor_core']}")
    return out


def rows(capability: int, log: Callable[[str], None] = print) -> list[dict]:
    out = []
    for launch in launches():
        found = row(launch, capability)
        if found is not None:
            log(f"sm_{capability} {found['kernel']:<24} {found['shape']:<34} regs {found['registers']:>3}  "
                f"spills {found['spill_bytes']}  shared {found['shared_bytes']:>6}  {found['tensor_core']:<5}  "
                f"loop {found['loop_instructions'] or '-'}")
            out.append(found)
    return out
