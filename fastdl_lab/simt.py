"""The GPU execution model in numbers (lab 01 gemm): SMs, coalescing, occupancy and waves.

A GPU is a few dozen to a hundred-odd streaming multiprocessors (SMs). A Triton program runs on
one SM as a block of ``num_warps`` warps of 32 threads; an SM holds as many programs at once as its
registers, shared memory and scheduler slots allow, and the grid runs in *waves* of that many
programs per SM. Memory is read by whole warps, in 32-byte sectors.

- ``GPUS``: the per-SM resources of the course GPUs (CUDA's table per compute capability) and
  their SM counts;
- ``warp_sectors``: the sectors one warp's load touches, for a given element stride: coalescing;
- ``occupancy``: programs of a compiled kernel resident per SM, and which resource limits them;
- ``waves``: how many rounds a grid of programs takes on a whole GPU.

Everything here is arithmetic on published limits and on what the compiler reports
(``triton_aot.resources``), so it is the same on a laptop and on the GPU it describes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WARP = 32
SECTOR_BYTES = 32  # the unit in which the memory system moves data to an SM
REGISTERS_PER_SM = 65536  # 32-bit registers, every architecture the course uses
REGISTER_UNIT = 256  # registers are handed to a warp in multiples of this


@dataclass(frozen=True)
class GPU:
    name: str
    capability: int  # 80 for sm_80, as triton_aot takes it
    sms: int
    max_warps_per_sm: int
    max_programs_per_sm: int  # CUDA's resident thread blocks per SM
    shared_bytes_per_sm: int
    l2_bytes: int
    # Shared memory the driver keeps for itself in every resident block (sm_80 and later).
    reserved_shared_per_program: int


_KIB, _MIB = 1 << 10, 1 << 20
GPUS: dict[str, GPU] = {
    "t4": GPU("T4", 75, 40, 32, 16, 64 * _KIB, 4 * _MIB, 0),
    "a100": GPU("A100 SXM4 80GB", 80, 108, 64, 32, 164 * _KIB, 40 * _MIB, _KIB),
    "l4": GPU("L4", 89, 58, 48, 24, 100 * _KIB, 48 * _MIB, _KIB),
    "h100": GPU("H100 SXM5 80GB", 90, 132, 64, 32, 228 * _KIB, 50 * _MIB, _KIB),
    "h200": GPU("H200 SXM 141GB", 90, 132, 64, 32, 228 * _KIB, 50 * _MIB, _KIB),
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def warp_sectors(stride_elems: int, elem_bytes: int = 4, lanes: int = WARP) -> int:
    """Distinct 32-byte sectors touched when lane ``i`` of a warp loads element ``i * stride_elems``.

    Stride 1 is a coalesced load: 32 fp32 values in 4 sectors, every fetched byte used. From a
    stride of 8 fp32 on, every lane pays for a sector of its own: 8 times the traffic.
    """
    if stride_elems < 0 or elem_bytes < 1 or lanes < 1:
        raise ValueError(f"need stride >= 0, elem_bytes >= 1, lanes >= 1; got {stride_elems}, {elem_bytes}, {lanes}")
    sectors = set()
    for lane in range(lanes):
        first = lane * stride_elems * elem_bytes
        sectors.update(range(first // SECTOR_BYTES, (first + elem_bytes - 1) // SECTOR_BYTES + 1))
    return len(sectors)


def load_efficiency(stride_elems: int, elem_bytes: int = 4) -> float:
    """Bytes a warp asked for over bytes the memory system moved for it."""
    return WARP * elem_bytes / (warp_sectors(stride_elems, elem_bytes) * SECTOR_BYTES)


@dataclass(frozen=True)
class Occupancy:
    programs_per_sm: int
    limits: dict[str, int]  # programs per SM each resource alone would allow

    @property
    def limited_by(self) -> str:
        return min(self.limits, key=self.limits.get)


def occupancy(registers: int, shared_bytes: int, num_warps: int, on: str | GPU = "h100") -> Occupancy:
    """Programs of a kernel that fit on one SM at once.

    ``registers`` per thread and ``shared_bytes`` per program are what the compiler reports
    (``triton_aot.resources``). A program that does not fit at all gives 0.
    """
    g = gpu(on) if isinstance(on, str) else on
    if registers < 0 or shared_bytes < 0 or num_warps < 1:
        raise ValueError(f"need registers >= 0, shared_bytes >= 0, num_warps >= 1; "
                         f"got {registers}, {shared_bytes}, {num_warps}")
    per_warp = math.ceil(registers * WARP / REGISTER_UNIT) * REGISTER_UNIT
    by_registers = (REGISTERS_PER_SM // per_warp) // num_warps if per_warp else g.max_programs_per_sm
    shared = shared_bytes + g.reserved_shared_per_program
    limits = {
        "registers": by_registers,
        "shared memory": g.shared_bytes_per_sm // shared if shared else g.max_programs_per_sm,
        "warp slots": g.max_warps_per_sm // num_warps,
        "program slots": g.max_programs_per_sm,
    }
    return Occupancy(min(limits.values()), limits)


def waves(programs: int, programs_per_sm: int, on: str | GPU = "h100") -> float:
    """Rounds of ``programs`` on the whole GPU; a last round only partly full costs a whole one."""
    g = gpu(on) if isinstance(on, str) else on
    if programs_per_sm < 1:
        raise ValueError("the program does not fit on an SM (0 resident): it cannot run")
    return programs / (programs_per_sm * g.sms)
