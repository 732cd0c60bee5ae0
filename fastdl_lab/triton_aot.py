"""Ahead-of-time compilation of Triton kernels to PTX, with no GPU present (lab 01 and later).

No development or CI machine has a GPU, so kernels run there under the Triton interpreter. The
interpreter never lowers a kernel to GPU code, so a kernel can pass every CPU test and still fail
to compile for a real GPU (a Python construct Triton's compiler rejects, a layout the tensor-core
path cannot take). Triton's compiler itself needs no driver when it is told the target: this
module asks it for PTX for a chosen compute capability, so every lab can prove that its kernels
would compile for an A100 (sm_80) or an H100 (sm_90).

    >>> from fastdl_lab import triton_aot
    >>> ptx = triton_aot.compile_to_ptx(kernel, {"x_ptr": "*fp32", "n": "i32"}, {"BLOCK": 1024},
    ...                                 capability=80)

Interpreter mode complicates this: with ``TRITON_INTERPRET=1`` every ``@triton.jit`` function
(the kernel, its helpers, and Triton's own library such as ``tl.cdiv`` or ``tl.sum``) is an
``InterpretedFunction``, which the compiler does not accept. ``compile_to_ptx`` therefore
builds compiler-side ``JITFunction`` twins for the duration of one compilation and puts every
original back afterwards.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

# Capabilities the course names; any integer Triton's NVIDIA backend knows is accepted.
CAPABILITIES = {80: "A100 (Ampere)", 89: "L4 (Ada)", 90: "H100 / H200 (Hopper)"}


def _interpreted_type():
    # The interpreter module is only imported lazily by Triton; importing it here is cheap and
    # keeps the type check exact rather than duck-typed.
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def _undo_interpreter_leaks() -> None:
    """Put back the ``triton.language`` functions a past interpreter run left replaced.

    To run a kernel the interpreter swaps the language's builtins (``tl.load``, ``tl.dot``...)
    for NumPy-backed versions in every ``triton.language`` module a jit function can see, and
    restores them afterwards, except on a call from one jit function into another (including
    into the library, such as ``tl.cdiv``): those patches stay in ``triton.language.core``.
    Compiling then trips over them, so they are reverted; they are the true originals, and the
    interpreter patches them again whenever it needs to.
    """
    import triton.language as tl

    core = tl.core
    for module in (tl, core, tl.math):
        for name, value in list(vars(module).items()):
            # A patched builtin is a lambda that keeps the original as its ``member`` default.
            member = (getattr(value, "__kwdefaults__", None) or {}).get("member")
            if getattr(value, "__name__", "") == "<lambda>" and core.is_builtin(member):
                setattr(module, name, member)
    # Other patched names (range, static_assert, multiple_of...) are re-exported by
    # triton.language itself, which a kernel run always restores; ``math`` is the one name the two
    # modules bind to different objects.
    for name, value in list(vars(tl).items()):
        if name in vars(core) and not name.startswith("__") and name != "math" and vars(core)[name] is not value:
            setattr(core, name, value)


@contextlib.contextmanager
def _compilable(kernel) -> Iterator[JITFunction]:
    """Yield a JITFunction for ``kernel``; under the interpreter, swap twins in while it is used."""
    if isinstance(kernel, JITFunction):
        yield kernel
        return
    interpreted = _interpreted_type()

    # The code generator imports Triton's experimental front end, which checks at import time that
    # the library functions match the interpreter setting; import it before anything is swapped.
    import triton.compiler.code_generator  # noqa: F401

    _undo_interpreter_leaks()
    twins: dict[int, JITFunction] = {}
    swapped: list[tuple[dict, str, object]] = []

    def twin(fn) -> JITFunction:
        key = id(fn)
        if key not in twins:
            twins[key] = JITFunction(fn.fn, **fn.kwargs)
            swap_in(fn.fn.__globals__)
        return twins[key]

    def swap_in(namespace: dict) -> None:
        for name, value in list(namespace.items()):
            if isinstance(value, interpreted):
                swapped.append((namespace, name, value))
                namespace[name] = twin(value)

    try:
        # Kernels call library functions as attributes of triton.language (tl.cdiv, tl.max), so
        # the library modules are swapped as namespaces too, not only the kernel's own globals.
        for name, module in list(sys.modules.items()):
            if module is not None and name.startswith("triton.language"):
                swap_in(vars(module))
        root = twin(kernel)
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            yield root
    finally:
        for namespace, name, value in reversed(swapped):
            namespace[name] = value


def arg_names(kernel) -> list[str]:
    """The parameters of a @triton.jit kernel (interpreted or not), in order."""
    if not isinstance(kernel, (JITFunction, _interpreted_type())):
        raise TypeError(f"expected a @triton.jit kernel, got {type(kernel).__name__}")
    code = kernel.fn.__code__
    return list(code.co_varnames[: code.co_argcount])


def compile_to_ptx(
    kernel,
    signature: dict[str, str],
    constexprs: dict,
    *,
    capability: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible_by_16: Iterable[str] | None = None,
) -> str:
    """Compile ``kernel`` for NVIDIA compute capability ``capability`` and return its PTX.

    Arguments as for ``compile_kernel``.
    """
    return compile_kernel(kernel, signature, constexprs, capability=capability, num_warps=num_warps,
                          num_stages=num_stages, divisible_by_16=divisible_by_16).asm["ptx"]


def compile_kernel(
    kernel,
    signature: dict[str, str],
    constexprs: dict,
    *,
    capability: int = 90,
    num_warps: int = 4,
    num_stages: int = 3,
    divisible_by_16: Iterable[str] | None = None,
):
    """Compile ``kernel`` for NVIDIA compute capability ``capability``: Triton's compiled kernel,
    with its PTX and cubin in ``.asm`` and its launch needs (shared memory) in ``.metadata``.

    ``signature`` maps every runtime argument to a Triton type (``"*fp32"``, ``"i32"``); the
    constexpr arguments may be left out of it, they are filled in from ``constexprs``.
    ``divisible_by_16`` names the arguments the launcher would see as multiples of 16 (pointers
    from PyTorch allocations are); by default every pointer argument. This is the specialisation
    that lets the compiler vectorise loads, exactly as a real launch would.

    Under the interpreter the swap of jit functions is process-wide while it lasts: do not run
    interpreted kernels on another thread during a compilation.
    """
    names = arg_names(kernel)
    unknown = sorted((set(signature) | set(constexprs)) - set(names))
    if unknown:
        raise ValueError(f"{getattr(kernel, '__name__', kernel)} has no argument(s) {unknown}; "
                         f"its arguments are {names}")
    full = {}
    for name in names:
        if name in constexprs:
            full[name] = "constexpr"
        elif name in signature:
            full[name] = signature[name]
        else:
            raise ValueError(f"argument {name!r} needs a type in signature or a value in constexprs")
    if divisible_by_16 is None:
        divisible_by_16 = [n for n, t in full.items() if t.startswith("*")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}

    with _compilable(kernel) as fn:
        src = ASTSource(fn=fn, signature=full, constexprs=dict(constexprs), attrs=attrs)
        compiled = triton.compile(
            src,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": num_warps, "num_stages": num_stages},
        )
    return compiled


def nvidia_tool(name: str) -> str:
    """Path of one of the CUDA tools Triton's NVIDIA backend ships (``ptxas``, ``cuobjdump``,
    ``nvdisasm``): the ones that built the cubin, so they read it the way it was made."""
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resources(compiled) -> dict[str, int]:
    """What one program of a compiled kernel occupies on an SM: registers per thread, shared
    memory per program (bytes), threads per program, and per thread the bytes of local memory and
    of stack frame. Registers that do not fit are spilled to the stack frame (``ptxas -v``'s "bytes
    spill stores"), so a kernel that spills has ``stack_bytes`` > 0 even where ``local_bytes`` is 0."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([nvidia_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                                text=True, check=True, timeout=60).stdout
    usage = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", report)
    if usage is None:
        raise RuntimeError(f"cuobjdump reported no resource usage: {report.strip()[:200]}")
    registers, stack, static_shared, local = (int(g) for g in usage.groups())
    # Triton's own buffers (pipelined tiles, reductions) are dynamic shared memory, in the metadata.
    return {"registers": registers, "shared_bytes": static_shared + int(compiled.metadata.shared),
            "threads": 32 * int(compiled.metadata.num_warps), "local_bytes": local, "stack_bytes": stack}


# Pointer element types a launch may pass, beyond the float formats the course's kernels take.
POINTER_TYPES = {**device.TRITON_TYPES, torch.float64: "fp64", torch.int8: "i8", torch.uint8: "u8",
                 torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "grid", "warmup"}


def launch_signature(kernel, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict]:
    """What ``kernel[grid](*args, **kwargs)`` asks of the compiler: a Triton type for every runtime
    argument, and the values of the constexpr ones (defaults filled in)."""
    # The interpreter's function object does not parse its parameters; a compiler-side twin does.
    params = JITFunction(kernel.fn).params
    values = {p.name: p.default for p in params if p.has_default}
    values.update(zip((p.name for p in params), args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature, constexprs = {}, {}
    for param in params:
        value = values.get(param.name)
        if param.is_constexpr or value is None:
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            if value.dtype not in POINTER_TYPES:
                raise TypeError(f"argument {param.name}: no Triton pointer type for {value.dtype}")
            signature[param.name] = "*" + POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"argument {param.name} has a type no kernel takes: {type(value).__name__}")
    return signature, constexprs


def compile_launch(kernel, args: tuple, kwargs: dict, *, capability: int = 90) -> str:
    """PTX of ``kernel`` for the arguments one launch gave it, with that launch's warps and stages."""
    signature, constexprs = launch_signature(kernel, args, kwargs)
    return compile_to_ptx(kernel, signature, constexprs, capability=capability,
                          num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))


def ptx_summary(ptx: str) -> dict[str, object]:
    """The few facts a lab prints about a PTX listing: target, tensor-core use, memory traffic."""
    target = next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), "?")
    return {
        "target": target,
        "lines": ptx.count("\n"),
        # Hopper's warpgroup MMA and Ampere's warp-level mma.sync are both tensor-core paths.
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma": ptx.count("mma.sync"),
        "global_loads": ptx.count("ld.global"),
        # Asynchronous global-to-shared copies are how the K loop is software-pipelined.
        "async_copies": len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
        "global_stores": ptx.count("st.global"),
    }
