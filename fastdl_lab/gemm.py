"""Matrix multiply, from Python loops to a tiled Triton kernel (lab 01 gemm).

The same product computed four ways, each a step up the roofline:

- ``matmul_loops``: three nested Python loops, for a handful of rows only;
- ``matmul_numpy``: NumPy, which hands the work to the machine's BLAS;
- ``matmul`` with ``_matmul_kernel``: a tiled Triton kernel with grouped program ordering,
  compiled for the GPU, or run by the Triton interpreter on a CPU (same source, for correctness
  only: the interpreter's speed says nothing about the kernel's);
- ``matmul_ref``: ``torch.matmul`` in fp32, the reference everything is checked against.

``grouped_pid_ref`` spells out the launch order the kernel uses, in plain Python, and
``tiles_touched`` counts what that order buys: fewer distinct tiles of A and B read by the
programs that run at the same time, hence more hits in the GPU's L2 cache.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
import triton.language as tl


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated in true fp32 (no TF32), returned in ``a``'s dtype."""
    return checks.exact_fp32_matmul(a.float(), b.float()).to(a.dtype)


# Pure Python manages a few 10^7 multiply-adds per second: this cap keeps a call under a tenth of
# a second, where a careless 1024^3 would take most of a minute.
LOOPS_MAX_MACS = 2_000_000


def matmul_loops(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Textbook triple loop over Python floats: the slowest honest matrix multiply."""
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: a is {m}x{k}, b is {k2}x{n}")
    if m * n * k > LOOPS_MAX_MACS:
        raise ValueError(f"{m}x{n}x{k} is too large for Python loops (limit {LOOPS_MAX_MACS:,} multiply-adds)")
    rows, cols = a.tolist(), b.tolist()
    out = [[0.0] * n for _ in range(m)]
    for i in range(m):
        row, out_row = rows[i], out[i]
        for p in range(k):
            x, b_row = row[p], cols[p]
            # i-p-j order: the inner loop runs along one row of b and one row of out, no column walks.
            for j in range(n):
                out_row[j] += x * b_row[j]
    return torch.tensor(out, dtype=a.dtype)


def matmul_numpy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """NumPy's ``@``, i.e. the host BLAS (OpenBLAS or MKL), in fp32 unless the input is fp64."""
    # NumPy has no bf16 and no BLAS path for fp16 (it falls back to slow loops), so 16-bit inputs
    # are multiplied in fp32 and rounded back, as a CPU library would do.
    host = torch.float64 if a.dtype == torch.float64 else torch.float32
    x, y = a.detach().cpu().to(host).numpy(), b.detach().cpu().to(host).numpy()
    return torch.from_numpy(x @ y).to(a.dtype)


def check_matmul(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, name: str = "matmul") -> None:
    """Raise ``checks.MismatchError`` unless ``actual`` is an acceptable ``a @ b`` for its precision.

    fp32 on the CPU must match the fp32 reference to fp32 tolerances. Where a low-precision format
    is involved (fp16, bf16, or fp32 on a GPU, where ``tl.dot`` uses TF32 tensor cores) the rule is
    "no worse than twice PyTorch's own error in that format", both measured against fp64; for TF32
    that error is ``checks.tf32_matmul``'s, since cuBLAS keeps small products in true fp32.
    """
    if a.dtype == torch.float32 and not a.is_cuda:
        checks.assert_close(actual, matmul_ref(a, b), name=name)
        return
    exact = torch.matmul(a.double(), b.double())
    lowp = checks.tf32_matmul(a, b) if a.dtype == torch.float32 else torch.matmul(a, b)
    checks.assert_low_precision_close(actual, exact, lowp, name=name)


def row_major_pid(pid: int, num_pid_m: int, num_pid_n: int) -> tuple[int, int]:
    """The naive launch order: program ``pid`` computes tile (pid // num_pid_n, pid % num_pid_n)."""
    if not 0 <= pid < num_pid_m * num_pid_n:
        raise ValueError(f"pid {pid} outside a {num_pid_m}x{num_pid_n} grid of tiles")
    return pid // num_pid_n, pid % num_pid_n


def grouped_pid_ref(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """Grouped launch order: bands of ``group_m`` tile rows, each band walked column by column.

    Consecutive programs stay within a band of ``group_m`` rows of A, and sweep the columns of B
    together, so the programs resident at one time share both operands. The last band may be
    shorter when ``group_m`` does not divide ``num_pid_m``.
    """
    if not 0 <= pid < num_pid_m * num_pid_n:
        raise ValueError(f"pid {pid} outside a {num_pid_m}x{num_pid_n} grid of tiles")
    if group_m < 1:
        raise ValueError(f"group_m must be at least 1, got {group_m}")
    ### BEGIN SOLUTION
    per_group = group_m * num_pid_n
    first_m = (pid // per_group) * group_m
    rows = min(num_pid_m - first_m, group_m)
    local = pid % per_group
    return first_m + local % rows, local // rows
    ### END SOLUTION


def tiles_touched(order_fn: Callable, num_pid_m: int, num_pid_n: int, wave: int, **kw) -> int:
    """Distinct row-blocks of A plus column-blocks of B read by programs ``0 .. wave-1``.

    ``wave`` stands for the programs a GPU runs at once (about one per SM); every distinct block
    they read must come from DRAM at least once, so fewer touched blocks means more L2 reuse.
    """
    rows, cols = set(), set()
    for pid in range(min(wave, num_pid_m * num_pid_n)):
        pid_m, pid_n = order_fn(pid, num_pid_m, num_pid_n, **kw)
        rows.add(pid_m)
        cols.add(pid_n)
    return len(rows) + len(cols)


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak,
    stride_bk, stride_bn,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr = False,
):
    """One program computes one BLOCK_M x BLOCK_N tile of C = A @ B.

    ``EVEN_K`` (set by the launcher when BLOCK_K divides K) drops the mask of the K loop.
    """
    ### BEGIN SOLUTION
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap round to real ones instead of being masked: every load
    # of the K loop is then in bounds with no per-element compare and select, and the products
    # they feed land in rows and columns of the tile that the store below masks off.
    a_ptrs = a_ptr + (offs_m % M)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + (offs_n % N)[None, :] * stride_bn

    # Accumulate in fp32 whatever the input type: summing K products in fp16 loses digits fast.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            # A ragged K cannot wrap (the wrapped products would add into the sum), so the last
            # step masks: elements past K load as 0 and add nothing.
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
    ### END SOLUTION


# Triton's own argument types for the kernel, for ahead-of-time compilation (see ``ptx``).
SIGNATURE = {
    "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*fp16",
    "M": "i32", "N": "i32", "K": "i32",
    "stride_am": "i32", "stride_ak": "i32",
    "stride_bk": "i32", "stride_bn": "i32",
    "stride_cm": "i32", "stride_cn": "i32",
}


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict[str, int]:
    return {"block_m": bm, "block_n": bn, "block_k": bk, "group_m": 8, "num_warps": warps, "num_stages": stages}


# The configurations triton.autotune tries on a GPU, per architecture, for 16-bit operands; the
# first is also the one a single-configuration launch uses. Every one compiles without register
# spills and within its SM's shared memory (tests/test_compiled_launch_configs.py): a block may
# have 227 KiB on an H100, 163 KiB on an A100. Each stage holds an A and a B tile,
# (block_m + block_n) * block_k * 2 bytes. Hopper's wgmma keeps a 128 x 256 accumulator in one program of two warp
# groups at about 220 registers a thread; Ampere's mma.sync needs more registers for the same
# tile, so its K-steps are shorter and its largest tiles pipeline 32 deep.
AUTOTUNE_CONFIGS = {
    90: [_tile(128, 256, 64, 8, 3), _tile(128, 128, 64, 8, 3), _tile(128, 128, 64, 4, 4),
         _tile(256, 128, 64, 8, 3), _tile(64, 128, 64, 4, 4)],
    80: [_tile(128, 256, 32, 8, 4), _tile(128, 128, 32, 4, 4), _tile(256, 128, 32, 8, 4),
         _tile(128, 128, 64, 8, 3), _tile(64, 128, 64, 4, 4)],
    # Other GPUs (a T4's 64 KiB, an L4's 99 KiB of shared memory per block): small pipelines only.
    None: [_tile(128, 128, 32, 4, 3), _tile(64, 128, 32, 4, 3), _tile(128, 64, 32, 4, 3)],
}


def _arch(capability: int) -> int | None:
    if capability >= 90:
        return 90
    # sm_86 and sm_89 have 99 KiB of shared memory per block, not the A100's 163 KiB.
    return 80 if capability in (80, 87) else None


def autotune_configs(capability: int, dtype: torch.dtype = torch.float16) -> list[dict[str, int]]:
    """The configurations ``matmul`` autotunes over on a GPU of ``capability`` (80 = A100, 90 = H100)."""
    if not isinstance(capability, int) or isinstance(capability, bool):
        raise ValueError(f"capability is an int such as 80 or 90, got {capability!r}")
    configs = [dict(c) for c in AUTOTUNE_CONFIGS[_arch(capability)]]
    if dtype == torch.float32:
        # fp32 operands are twice as wide: half the K-step keeps each stage's bytes. TF32 operand
        # fragments also take twice the registers, which 256-wide tiles cannot spare (sm_90's
        # 128 x 256 compiles at the 255-register limit).
        configs = [{**c, "block_k": c["block_k"] // 2} for c in configs if max(c["block_m"], c["block_n"]) < 256]
    return configs


def default_config(dtype: torch.dtype, capability: int | None) -> dict[str, int]:
    """The configuration of a single-configuration launch: for the CPU interpreter (``capability``
    None), or on a GPU the first of ``autotune_configs`` (a student's kernel, or explicit options)."""
    if capability is None:
        # The interpreter's cost grows with the number of programs, not with FLOPs: large tiles
        # keep the CPU runs short (256^3 takes ~0.17 s with 64x64 tiles, ~4x longer with 32x32).
        return {"block_m": 64, "block_n": 64, "block_k": 32, "group_m": 8, "num_warps": 4, "num_stages": 1}
    return autotune_configs(capability, dtype)[0]


# What a launch may tune, and the values it may take: tl.dot wants power-of-two tiles of at least
# 16 a side (256 is past what any course GPU holds in registers), warps come in powers of two.
CONFIG_RANGES = {
    "block_m": (16, 256), "block_n": (16, 256), "block_k": (16, 256),
    "group_m": (1, 64), "num_warps": (1, 16), "num_stages": (1, 8),
}
POWERS_OF_TWO = ("block_m", "block_n", "block_k", "num_warps")


def check_config(config: dict) -> dict[str, int]:
    """``config`` (any of ``CONFIG_RANGES``' keys) as plain ints; ValueError naming what is wrong."""
    if not isinstance(config, dict):
        raise ValueError(f"a GEMM configuration is a dict, got {type(config).__name__}")
    checked = {}
    for key, value in config.items():
        if key not in CONFIG_RANGES:
            raise ValueError(f"unknown configuration key {key!r}; the keys are {', '.join(CONFIG_RANGES)}")
        low, high = CONFIG_RANGES[key]
        kind = "a power of two" if key in POWERS_OF_TWO else "an int"
        # bool is an int subclass: True would pass as 1.
        if type(value) is not int or not low <= value <= high or (key in POWERS_OF_TWO and value & (value - 1)):
            raise ValueError(f"{key} must be {kind} from {low} to {high}, got {value!r}")
        checked[key] = value
    return checked


def _check_operands(a, b) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}")
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}; cast one of them first")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {a.shape[0]}x{a.shape[1]}, b is {b.shape[0]}x{b.shape[1]}")
    device.check_kernel_tensor(a, "a and b are")


def _declares(kernel, name: str) -> bool:
    """Whether ``kernel`` (a jit function, interpreted or not) has a parameter ``name``; False for
    anything else, which its launch then rejects."""
    try:
        return name in inspect.signature(kernel.fn).parameters
    except (AttributeError, TypeError, ValueError):
        return False


@functools.cache
def _autotuned(capability: int, dtype: torch.dtype):
    """The reference kernel under ``triton.autotune`` over ``autotune_configs(capability, dtype)``."""
    configs = [triton.Config({"BLOCK_M": c["block_m"], "BLOCK_N": c["block_n"], "BLOCK_K": c["block_k"],
                              "GROUP_M": c["group_m"]}, num_warps=c["num_warps"], num_stages=c["num_stages"])
               for c in autotune_configs(capability, dtype)]
    # Heuristics run after the autotuner has chosen BLOCK_K, so EVEN_K follows each configuration.
    even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_matmul_kernel)
    return triton.autotune(configs=configs, key=["M", "N", "K"])(even_k)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    kernel=None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    group_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """C = A @ B with a Triton kernel (``kernel`` defaults to the reference ``_matmul_kernel``).

    ``kernel`` must take ``_matmul_kernel``'s arguments (``EVEN_K`` is passed only to a kernel that
    declares it). The result has the inputs' dtype, with fp32 accumulation. On a GPU, fp32 inputs
    go through ``tl.dot``'s default TF32 tensor-core path, like ``torch.matmul`` with
    ``allow_tf32 = True``. On a GPU the reference kernel with no option given is autotuned over
    ``autotune_configs`` for each (M, N, K); otherwise tiles and launch options left out come
    from ``default_config``, and ``check_config`` says what each may be.
    """
    _check_operands(a, b)
    given = check_config({k: v for k, v in {
        "block_m": block_m, "block_n": block_n, "block_k": block_k, "group_m": group_m,
        "num_warps": num_warps, "num_stages": num_stages}.items() if v is not None})
    capability = device.capability(a)

    (M, K), N = a.shape, b.shape[1]
    c = checks.output_buffer((M, N), a.dtype, a)
    if M == 0 or N == 0:
        return c
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if capability is not None and kernel is None and not given:
        _autotuned(capability, a.dtype)[
            lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)](*args)
        return c
    config = {**default_config(a.dtype, capability), **given}
    kernel = kernel or _matmul_kernel
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    extra = {"EVEN_K": K % bk == 0} if _declares(kernel, "EVEN_K") else {}
    kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config["group_m"], **extra,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )
    return c


def ptx(capability: int = 90, dtype: torch.dtype = torch.float16, kernel=None, **options) -> str:
    """PTX of the GEMM kernel for an NVIDIA GPU of ``capability`` (80 = A100, 90 = H100), no GPU needed;
    ``compiled``'s arguments."""
    return compiled(capability, dtype, kernel, **options).asm["ptx"]


def resources(capability: int = 90, dtype: torch.dtype = torch.float16, kernel=None, **options) -> dict[str, int]:
    """Registers per thread, shared memory per program and threads of one program of the GEMM
    kernel compiled as ``compiled`` does for ``capability``: what decides how many programs share
    an SM (``simt.occupancy``)."""
    from fastdl_lab import triton_aot

    return triton_aot.resources(compiled(capability, dtype, kernel, **options))


def compiled(capability: int = 90, dtype: torch.dtype = torch.float16, kernel=None, *,
             config: dict | None = None, even_k: bool = True, **overrides):
    """Triton's compiled GEMM kernel for ``capability``, no GPU needed.

    The configuration is ``config`` (one of ``autotune_configs(capability, dtype)``, say) or else
    ``default_config(dtype, capability)``, the one a single-configuration launch uses, with
    ``overrides`` (tiles, warps, stages) on top. Compiled as a launch on contiguous row-major
    operands with sizes that are multiples of 16 would be: Triton turns an integer argument equal
    to 1 into a constant and marks multiples of 16, which is what lets it prove the loads
    contiguous and aligned, and so vectorise them. ``even_k`` is the launcher's EVEN_K (for a
    kernel that declares it): False compiles the masked K loop that a ragged K launches.
    """
    from fastdl_lab import triton_aot

    config = {**(config or default_config(dtype, capability)), **check_config(overrides)}
    ty = device.TRITON_TYPES[dtype]
    kernel = kernel or _matmul_kernel
    signature = {**SIGNATURE, "a_ptr": f"*{ty}", "b_ptr": f"*{ty}", "c_ptr": f"*{ty}"}
    constexprs = {"BLOCK_M": config["block_m"], "BLOCK_N": config["block_n"],
                  "BLOCK_K": config["block_k"], "GROUP_M": config["group_m"],
                  "stride_ak": 1, "stride_bn": 1, "stride_cn": 1}
    if _declares(kernel, "EVEN_K"):
        constexprs["EVEN_K"] = even_k
    aligned = ["a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm"]
    return triton_aot.compile_kernel(kernel, signature, constexprs, capability=capability,
                                     num_warps=config["num_warps"], num_stages=config["num_stages"],
                                     divisible_by_16=aligned)


# Benchmark spec: what benchmarks/gemm.py runs. Every row reports a speedup over torch.matmul on
# the same inputs. CPU sizes suit a 2-core machine and the Python loops only ever see tiny ones;
# NumPy also runs on a GPU host, so the GPU-vs-CPU comparison is made on one machine.
BENCHMARK = {
    "name": "gemm",
    "cpu": {"loops": [32, 64], "numpy": [128, 512, 1024], "torch": [128, 512, 1024]},
    "gpu": {"numpy": [1024, 2048], "torch": [1024, 2048, 4096, 8192], "torch_tf32": [1024, 2048, 4096, 8192],
            "triton": [1024, 2048, 4096, 8192]},
    "dtypes": {"cpu": [torch.float32], "gpu": [torch.float16, torch.float32]},
    # The interpreter's speed says nothing about a kernel's, and TF32 is a tensor-core format.
    "gpu_only": ["triton", "torch_tf32"],
}


def _variant_fn(variant: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    def tf32():
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return torch.matmul(a, b)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous

    return {
        "loops": lambda: matmul_loops(a, b),
        "numpy": lambda: matmul_numpy(a, b),
        "torch": lambda: torch.matmul(a, b),
        "torch_tf32": tf32,
        "triton": lambda: matmul(a, b),
    }[variant]


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Time every variant of the spec that this machine can run; one dict per measurement."""
    from fastdl_lab import measure, timing

    on_gpu = device.has_gpu()
    where = "gpu" if on_gpu else "cpu"
    if not on_gpu:
        log(f"{', '.join(BENCHMARK['gpu_only'])}: needs a GPU (the interpreter times Python, not the kernel)")

    def operands(size, dtype):
        a = checks.randn(size, size, dtype=dtype, seed=1, device="cuda" if on_gpu else "cpu")
        return a, checks.randn(size, size, dtype=dtype, seed=2, device=a.device)

    rows = []
    for dtype in BENCHMARK["dtypes"][where]:
        # NumPy has no fast 16-bit path and TF32 only concerns fp32 inputs.
        variants = {v: sizes for v, sizes in BENCHMARK[where].items()
                    if dtype == torch.float32 or v not in ("numpy", "torch_tf32", "loops")}
        # Host libraries are timed one at a time, torch.matmul first for every size: right after
        # NumPy calls, OpenBLAS's worker threads still spin and starve OpenMP's (and the other way
        # round), which can slow torch.matmul down a hundredfold on a 2-core machine.
        host_sizes = sorted({s for v, sizes in variants.items() if v not in BENCHMARK["gpu_only"] for s in sizes})
        torch_timings = {}
        for size in host_sizes:
            a, b = operands(size, dtype)
            torch_timings[size] = timing.bench(lambda: torch.matmul(a, b), reps=reps)
        for variant, sizes in variants.items():
            for size in sizes:
                a, b = operands(size, dtype)
                # On a GPU host NumPy gets its operands in host memory, so the row compares the
                # CPU with the GPU rather than timing a device-to-host copy.
                fn = _variant_fn(variant, *((a.cpu(), b.cpu()) if variant == "numpy" else (a, b)))
                ci = (None, None)
                if variant in BENCHMARK["gpu_only"]:
                    # Two kernels on one GPU stream: interleave them, as graded comparisons do.
                    cmp = timing.compare(fn, lambda: torch.matmul(a, b), reps=reps)
                    t, speedup, ci = cmp.candidate, cmp.speedup, (cmp.ci_low, cmp.ci_high)
                else:
                    slow = variant == "loops"
                    # sync=True: host work on a GPU machine is timed on the host clock.
                    t = torch_timings[size] if variant == "torch" else timing.bench(
                        fn, warmup=1 if slow else 3, reps=3 if slow else reps, sync=True)
                    speedup = torch_timings[size].median / t.median
                m = n = k = size
                flop = measure.matmul_flops_ref(m, n, k)
                moved = measure.matmul_bytes_ref(m, n, k, dtype.itemsize)
                row = {
                    "op": "gemm", "variant": variant, "m": m, "n": n, "k": k,
                    "dtype": str(dtype).replace("torch.", ""), "median_s": t.median, "iqr_s": t.iqr,
                    "tflops": flop / t.median / 1e12, "gbs": moved / t.median / 1e9,
                    "intensity": measure.arithmetic_intensity_ref(flop, moved),
                    "speedup_vs_torch": speedup, "ci_low": ci[0], "ci_high": ci[1],
                }
                rows.append(row)
                log(f"{variant:>10} {m}x{n}x{k} {row['dtype']:>8}: {t.median * 1e3:10.3f} ms "
                    f"{row['tflops']:8.4f} TFLOP/s  {speedup:.3g}x torch.matmul")
    return rows


def check() -> None:
    """Correctness of every version on a few ragged shapes; raises on the first mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for m, n, k in [(1, 1, 1), (37, 45, 50), (130, 70, 100)]:
            a = checks.randn(m, k, dtype=dtype, seed=1, device=dev)
            b = checks.randn(k, n, dtype=dtype, seed=2, device=dev)
            check_matmul(matmul(a, b), a, b, name=f"gemm {dtype} {m}x{n}x{k}")
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    checks.assert_close(matmul_loops(a, b), matmul_ref(a, b), name="loops")
    checks.assert_close(matmul_numpy(a, b), matmul_ref(a, b), name="numpy")
    tiles = sorted(grouped_pid_ref(p, 5, 3, 2) for p in range(15))
    assert tiles == [(i, j) for i in range(5) for j in range(3)], "grouped order is not a bijection"
    print("gemm: checks passed")


if __name__ == "__main__":
    check()
    benchmark()
