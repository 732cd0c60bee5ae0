"""Row softmax: five eager passes over memory, or one fused Triton kernel (lab 02 fusion).

Softmax is the textbook bandwidth-bound operation: a handful of FLOPs per element, so its speed
is set by how many times the data crosses the memory bus.

- ``softmax_ref``: ``torch.softmax`` computed in fp32 and rounded back, the reference;
- ``softmax_eager_steps``: max, subtract, exp, sum, divide as five separate PyTorch ops, each
  writing its result to memory and the next one reading it back;
- ``softmax_bytes_ref``: the element traffic of both versions, the lab's counting contract;
- ``softmax`` with ``_softmax_kernel``: one Triton program per row, any row length. A row that
  fits the block is read once, every exp taken once; longer rows use the *online* softmax (a
  running maximum, and a running sum rescaled whenever the maximum grows), then a second sweep
  writes the result;
- ``default_config`` picks the block and warps of a launch for the GPU it runs on, and
  ``compiled``/``ptx`` compile exactly that for sm_80 or sm_90 without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
import triton.language as tl


def softmax_ref(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, computed in fp32, returned in ``x``'s dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def softmax_eager_steps(x: torch.Tensor) -> torch.Tensor:
    """The unfused softmax: five PyTorch ops, five round trips through memory."""
    row_max = x.amax(dim=-1, keepdim=True)
    shifted = x - row_max
    numerators = torch.exp(shifted)
    denominators = numerators.sum(dim=-1, keepdim=True)
    return numerators / denominators


def softmax_bytes_ref(n_rows: int, n_cols: int, bytes_per_elem: int) -> tuple[int, int]:
    """(naive, fused) bytes moved by a softmax of an ``n_rows x n_cols`` matrix.

    Naive: each of the five eager ops (``softmax_eager_steps``) reads its inputs from memory and
    writes its output back. Fused: one kernel reads the matrix and writes the result. The
    per-op counts are the lab's exercise, so they are worked out below, not here.
    """
    ### BEGIN SOLUTION
    # With M rows and N columns: max reads MN, writes M; subtract reads MN + M, writes MN; exp
    # reads MN, writes MN; sum reads MN, writes M; divide reads MN + M, writes MN: 8MN + 4M in all.
    # Fused: the matrix read once, the result written once, 2MN.
    m, n = n_rows, n_cols
    naive = (m * n + m) + (m * n + m + m * n) + 2 * m * n + (m * n + m) + (m * n + m + m * n)
    return naive * bytes_per_elem, 2 * m * n * bytes_per_elem
    ### END SOLUTION


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n_cols, stride_xm, stride_ym, BLOCK_N: tl.constexpr):
    """One program per row: one pass when the row fits the block, otherwise an online sweep for the
    max and the sum, then a sweep that writes."""
    ### BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    offs = tl.arange(0, BLOCK_N)

    if n_cols <= BLOCK_N:
        # The whole row is in registers: one read, one exp per element, one write.
        in_row = offs < n_cols
        # Padding loads as -inf, which exp turns into 0: it neither wins the max nor adds.
        x = tl.load(x_row + offs, mask=in_row, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + offs, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=in_row)
    else:
        # run_sum is the sum of exp(x - run_max) over the columns seen so far. When a block raises
        # the maximum, the old sum is rescaled by exp(old max - new max): one read of the row gives
        # both statistics, however many blocks it spans.
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.zeros((), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, tl.max(x, axis=0))
            # While every value so far is -inf, shifting by the max would give -inf - -inf = NaN;
            # shifting by 0 gives the same zeros without it.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
            run_max = new_max

        for start in range(0, n_cols, BLOCK_N):
            cols = start + offs
            in_row = cols < n_cols
            x = tl.load(x_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
            y = tl.exp(x - run_max) / run_sum
            tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)
    ### END SOLUTION


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n_cols": "i32", "stride_xm": "i32", "stride_ym": "i32"}
# The largest block a row gets by default; past it a row spans several blocks (the online path).
# On the CPU the interpreter's cost is per block operation, so big blocks are cheap. On a GPU a
# row of one block is held in registers, in fp32 whatever its type: 8192 values over 16 warps are
# 16 a thread, about 32 registers and no spills on sm_80 and sm_90
# (tests/test_compiled_launch_configs.py), so 16-bit rows of up to 8192 are read once. fp32 rows
# stop at 4096, the same 16 KiB of row per program.
MAX_BLOCK = {"cpu": 1024, "gpu": {torch.float32: 4096, torch.float16: 8192, torch.bfloat16: 8192}}


def max_block(dtype: torch.dtype, capability: int | None) -> int:
    """The largest default block for ``dtype`` under the interpreter (``capability`` None) or on a GPU."""
    return MAX_BLOCK["cpu"] if capability is None else MAX_BLOCK["gpu"][dtype]


def num_warps_for(block_n: int) -> int:
    # More warps for longer blocks keep each thread's share of the row at 16 values or fewer up to
    # 8192 (a 4-warp program holds at most 8).
    return 4 if block_n <= 1024 else 8 if block_n <= 4096 else 16


def default_config(n_cols: int, dtype: torch.dtype, capability: int | None,
                   block_n: int | None = None) -> dict[str, int]:
    """Block and warps of a launch on rows of ``n_cols`` (``capability`` None: the CPU interpreter).

    The block is the next power of two at least ``n_cols`` (and 16), capped by ``max_block``;
    ``block_n`` forces it (a power of two >= 16), as the tests do to make rows span several.
    """
    if block_n is None:
        block_n = min(max(16, triton.next_power_of_2(max(n_cols, 1))), max_block(dtype, capability))
    elif type(block_n) is not int or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    return {"block_n": block_n, "num_warps": num_warps_for(block_n)}


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows x columns), got shape {tuple(x.shape)}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x needs a contiguous last dimension (strides {x.stride()}); call .contiguous()")
    device.check_kernel_tensor(x, "x is")


def softmax(x: torch.Tensor, *, kernel=None, block_n: int | None = None) -> torch.Tensor:
    """Softmax over the rows of ``x`` with a Triton kernel (default ``_softmax_kernel``).

    ``kernel`` must take ``_softmax_kernel``'s arguments. ``block_n`` (a power of two >= 16)
    overrides ``default_config``'s block; a block shorter than the rows makes every row span several.
    """
    _check_input(x)
    n_rows, n_cols = x.shape
    config = default_config(n_cols, x.dtype, device.capability(x), block_n)
    y = checks.output_buffer((n_rows, n_cols), x.dtype, x)
    if n_rows == 0 or n_cols == 0:
        return y
    (kernel or _softmax_kernel)[(n_rows,)](
        x, y, n_cols, x.stride(0), y.stride(0), BLOCK_N=config["block_n"], num_warps=config["num_warps"],
    )
    return y


def check_softmax(actual: torch.Tensor, x: torch.Tensor, name: str = "softmax") -> None:
    """Raise ``checks.MismatchError`` unless ``actual`` is an acceptable softmax of ``x``.

    fp32 must match the reference to fp32 tolerances; 16-bit results must be no worse than twice
    PyTorch's own softmax in that format, both measured against the fp32 computation.
    """
    if x.dtype == torch.float32:
        checks.assert_close(actual, softmax_ref(x), name=name)
        return
    checks.assert_low_precision_close(actual, torch.softmax(x.float(), dim=-1), torch.softmax(x, dim=-1),
                                      name=name)


def compiled(capability: int = 90, dtype: torch.dtype = torch.float32, n_cols: int = 1024, *,
             block_n: int | None = None, kernel=None):
    """Triton's compiled softmax kernel (or ``kernel``, same arguments) for an NVIDIA GPU of
    ``capability`` (80 = A100, 90 = H100), no GPU needed, at ``default_config``'s block and warps for
    rows of ``n_cols``: what ``softmax`` launches there.

    Compiled as a launch on a contiguous matrix whose row length is a multiple of 16 would be:
    aligned pointers and strides let the compiler vectorise the row loads.
    """
    from fastdl_lab import triton_aot

    config = default_config(n_cols, dtype, capability, block_n)
    ty = device.TRITON_TYPES[dtype]
    signature = {**SIGNATURE, "x_ptr": f"*{ty}", "y_ptr": f"*{ty}"}
    return triton_aot.compile_kernel(kernel or _softmax_kernel, signature, {"BLOCK_N": config["block_n"]},
                                     capability=capability, num_warps=config["num_warps"],
                                     divisible_by_16=["x_ptr", "y_ptr", "n_cols", "stride_xm", "stride_ym"])


def ptx(capability: int = 90, dtype: torch.dtype = torch.float32, n_cols: int = 1024, *,
        block_n: int | None = None, kernel=None) -> str:
    """PTX of ``compiled(...)``."""
    return compiled(capability, dtype, n_cols, block_n=block_n, kernel=kernel).asm["ptx"]


# Benchmark spec: what benchmarks/softmax.py runs. Every variant normalises by the fused traffic
# (read once, write once), so GB/s compares the versions on the bytes the job truly needs; the
# eager row also reports its own five-pass traffic. The interpreter's speed is not a kernel's, so
# the Triton rows need a GPU; torch.compile stands in for a fused kernel on the CPU. CPU matrices
# stay at 16 MiB or less: glibc serves larger allocations with fresh pages from the kernel on every
# call, and the page faults of each new output would dominate the timings.
BENCHMARK = {
    "name": "softmax",
    "cpu": {"rows": 4096, "cols": [128, 512, 1024], "variants": ["torch", "eager_steps", "compiled"]},
    "gpu": {"rows": 8192, "cols": [256, 1024, 4096, 16384],
            "variants": ["torch", "eager_steps", "compiled", "triton"]},
    "dtypes": {"cpu": [torch.float32], "gpu": [torch.float32, torch.float16]},
    "gpu_only": ["triton"],
}


def _variants(names: list[str]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    fns = {"torch": lambda x: torch.softmax(x, dim=-1), "eager_steps": softmax_eager_steps, "triton": softmax}
    if "compiled" in names:
        # One compiled function for every size: shapes after the first compile as dynamic.
        fns["compiled"] = torch.compile(softmax_eager_steps)
    return {name: fns[name] for name in names}


def benchmark(reps: int = 10, log: Callable[[str], None] = print) -> list[dict]:
    """Time every variant of the spec on this machine; one dict per measurement."""
    from fastdl_lab import timing

    on_gpu = device.has_gpu()
    where = "gpu" if on_gpu else "cpu"
    spec = BENCHMARK[where]
    if not on_gpu:
        log(f"{', '.join(BENCHMARK['gpu_only'])}: needs a GPU (the interpreter times Python, not the kernel)")
    fns = _variants(spec["variants"])
    rows = []
    for dtype in BENCHMARK["dtypes"][where]:
        for n_cols in spec["cols"]:
            m = spec["rows"]
            x = checks.randn(m, n_cols, dtype=dtype, seed=n_cols, device="cuda" if on_gpu else "cpu")
            naive, fused = softmax_bytes_ref(m, n_cols, dtype.itemsize)
            # Each variant is timed interleaved with torch.softmax; the warm-up absorbs
            # torch.compile's compilation of a new shape. torch's own row takes the baseline of
            # the first comparison.
            comparisons = {v: timing.compare(lambda: fn(x), lambda: fns["torch"](x), reps=reps)
                           for v, fn in fns.items() if v != "torch"}
            comparisons = {"torch": next(iter(comparisons.values())).baseline, **comparisons}
            for variant, result in comparisons.items():
                t = getattr(result, "candidate", result)
                row = {"op": "softmax", "variant": variant, "m": m, "n": n_cols,
                       "dtype": str(dtype).replace("torch.", ""), "median_s": t.median, "iqr_s": t.iqr,
                       "gbs": fused / t.median / 1e9,
                       "traffic_gbs": (naive if variant == "eager_steps" else fused) / t.median / 1e9,
                       "speedup_vs_torch": getattr(result, "speedup", 1.0)}
                rows.append(row)
                log(f"{variant:>12} {m}x{n_cols} {row['dtype']:>8}: {t.median * 1e3:9.3f} ms "
                    f"{row['gbs']:8.2f} GB/s  {row['speedup_vs_torch']:.2f}x torch.softmax")
    return rows


def check() -> None:
    """The kernel on ragged, multi-block, large and -inf rows; raises on the first mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for m, n, block in [(1, 1, None), (37, 45, None), (9, 300, 32), (5, 1500, None)]:
            x = checks.randn(m, n, dtype=dtype, seed=m, device=dev, scale=3.0)
            check_softmax(softmax(x, block_n=block), x, name=f"softmax {dtype} {m}x{n}")
    x = checks.randn(6, 100, seed=3, device=dev, scale=1e4)
    x[:, :40] = float("-inf")
    check_softmax(softmax(x, block_n=16), x, name="large values and -inf")
    assert softmax_bytes_ref(2, 3, 4) == (224, 48)
    print("softmax: checks passed")


if __name__ == "__main__":
    check()
    benchmark()
