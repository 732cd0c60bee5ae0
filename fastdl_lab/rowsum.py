"""Row sums, the warm-up kernel of lab 01 gemm: programs, constexpr blocks, offsets and masks.

A row sum is a matrix multiply by a column of ones, so its kernel has the GEMM's skeleton without
the tiling arithmetic: each program owns a block of rows, walks along the columns one block at a
time with masks on both ragged edges, accumulates in fp32 and stores one value per row.

- ``row_sum_ref``: the sum in float64, rounded to the input's dtype;
- ``row_sum`` with ``_row_sum_kernel``: one Triton program per ``BLOCK_M`` rows, any strides (a
  padded view, a transposed one), run by the interpreter on a CPU;
- ``check_row_sum``: the rule every check of the warm-up uses;
- ``compiled``/``ptx``: the kernel compiled for an NVIDIA GPU at the launch's configuration, with
  the column stride known to be 1 or not, which is where coalesced, vectorised loads come from.
"""

from __future__ import annotations

import torch

from fastdl_lab import checks
from fastdl_lab import device  # before triton: switches the interpreter on when there is no GPU

import triton
import triton.language as tl


def row_sum_ref(x: torch.Tensor) -> torch.Tensor:
    """Sum of every row of a 2-D ``x``, computed in float64 and returned in ``x``'s dtype."""
    return x.double().sum(dim=1).to(x.dtype)


@triton.jit
def _row_sum_kernel(
    x_ptr, y_ptr,
    M, N,
    stride_xm, stride_xn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program ``pid`` sums rows ``pid * BLOCK_M`` to ``pid * BLOCK_M + BLOCK_M - 1`` of x."""
    ### BEGIN SOLUTION
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    # The row offsets do not change along the sweep: one column of pointers, reused.
    row_ptrs = x_ptr + rows[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        c = start + cols
        # Masked-off elements read as 0: the last rows of the last program, and the columns past N
        # of the last step, add nothing (and are never read, so padding or the next row stays unseen).
        x = tl.load(row_ptrs + c[None, :] * stride_xn, mask=row_ok[:, None] & (c[None, :] < N), other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=row_ok)
    ### END SOLUTION


def default_config(capability: int | None) -> dict[str, int]:
    """Blocks and warps of a launch on a GPU of ``capability`` (None: the CPU interpreter); the
    grader and the tests also force small blocks."""
    if capability is None:
        # The interpreter pays per program and per block operation, not per element: few, wide blocks.
        return {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 1}
    # A few rows per program and a wide column block: each warp reads long contiguous runs.
    # Three stages (Triton's default) let the compiler prefetch the next column block.
    return {"block_m": 4, "block_n": 512, "num_warps": 4, "num_stages": 3}


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows x columns), got shape {tuple(x.shape)}")
    device.check_kernel_tensor(x, "x is")


def row_sum(x: torch.Tensor, *, kernel=None, block_m: int | None = None, block_n: int | None = None,
            num_warps: int | None = None) -> torch.Tensor:
    """Sum of every row of ``x`` with a Triton kernel (``kernel`` defaults to ``_row_sum_kernel``).

    ``x`` may have any strides: the kernel gets both. ``kernel`` must take ``_row_sum_kernel``'s
    arguments. The result has ``x``'s dtype; the sums are accumulated in fp32.
    """
    _check_input(x)
    config = default_config(device.capability(x))
    for key, value in (("block_m", block_m), ("block_n", block_n), ("num_warps", num_warps)):
        if value is not None:
            config[key] = value
    for key in ("block_m", "block_n", "num_warps"):
        size = config[key]
        # tl.arange takes power-of-two lengths only, and warps come in powers of two.
        if not isinstance(size, int) or size < 1 or size & (size - 1):
            raise ValueError(f"{key} must be a power of two, got {size!r}")
    m, n = x.shape
    y = checks.output_buffer((m,), x.dtype, x)
    if m == 0:
        return y
    grid = (triton.cdiv(m, config["block_m"]),)
    (kernel or _row_sum_kernel)[grid](
        x, y, m, n, x.stride(0), x.stride(1),
        BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return y


def check_row_sum(actual: torch.Tensor, x: torch.Tensor, name: str = "row sums") -> None:
    """Raise ``checks.MismatchError`` unless ``actual`` holds the row sums of ``x``.

    Summation order is free, so the allowance scales with the largest row's sum of magnitudes
    (fp32 accumulation in any order stays well inside 1e-5 of it), plus two roundings of a 16-bit
    result. An element dropped or read twice, a row never written (NaN on the CPU), or 16-bit
    accumulation over a long row all fall outside it.
    """
    mass = float(x.double().abs().sum(dim=1).max()) if x.numel() else 0.0
    rtol = 1e-5 if x.dtype == torch.float32 else 2 * torch.finfo(x.dtype).eps
    checks.assert_close(actual, row_sum_ref(x), atol=1e-5 * (1.0 + mass), rtol=rtol, name=name)


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_xn": "i32"}


def compiled(capability: int = 90, dtype: torch.dtype = torch.float32, *, contiguous: bool = True,
             kernel=None, **overrides):
    """Triton's compiled row-sum kernel for an NVIDIA GPU of ``capability`` (80 = A100, 90 = H100),
    no GPU needed, at ``default_config(capability)`` with ``overrides`` (block_m, block_n, num_warps)
    on top: by default what ``row_sum`` launches there.

    ``contiguous=True`` compiles it as a launch on row-major rows would be: Triton turns a stride
    equal to 1 into a constant, so it knows neighbouring columns are neighbouring addresses and can
    load several per instruction. ``False`` leaves the column stride unknown.
    """
    from fastdl_lab import triton_aot

    config = default_config(capability)
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the options are {sorted(config)}")
    config.update(overrides)
    ty = device.TRITON_TYPES[dtype]
    signature = {**SIGNATURE, "x_ptr": f"*{ty}", "y_ptr": f"*{ty}"}
    constexprs = {"BLOCK_M": config["block_m"], "BLOCK_N": config["block_n"]}
    if contiguous:
        constexprs["stride_xn"] = 1
        del signature["stride_xn"]
    return triton_aot.compile_kernel(kernel or _row_sum_kernel, signature, constexprs, capability=capability,
                                     num_warps=config["num_warps"], num_stages=config["num_stages"],
                                     divisible_by_16=["x_ptr", "y_ptr", "N", "stride_xm"])


def ptx(capability: int = 90, dtype: torch.dtype = torch.float32, *, contiguous: bool = True, kernel=None,
        **overrides) -> str:
    """PTX of ``compiled(...)``."""
    return compiled(capability, dtype, contiguous=contiguous, kernel=kernel, **overrides).asm["ptx"]


def check() -> None:
    """The kernel on ragged, padded and transposed inputs; raises on the first mismatch."""
    dev = "cuda" if device.has_gpu() else "cpu"
    for dtype in (torch.float32, torch.float16):
        for m, n, blocks in [(1, 1, {}), (37, 300, {}), (130, 77, {"block_m": 8, "block_n": 16}), (5, 0, {})]:
            x = checks.randn(m, n, dtype=dtype, seed=m + n, device=dev)
            check_row_sum(row_sum(x, **blocks), x, name=f"row_sum {dtype} {m}x{n}")
    wide = checks.randn(20, 50, seed=1, device=dev)
    check_row_sum(row_sum(wide[:, :33]), wide[:, :33], name="padded rows")
    check_row_sum(row_sum(wide.t()), wide.t(), name="transposed")
    print("rowsum: checks passed")


if __name__ == "__main__":
    check()
