"""Host-to-device copies: what feeding a GPU costs against computing on it (lab 06 data).

Every batch crosses the link between host and GPU (PCIe, or NVLink-C2C on a Grace Hopper) before
the GPU can use it. From ordinary, *pageable* host memory the driver first copies the bytes into a
pinned staging buffer and the copy blocks the host; from *pinned* (page-locked) memory the GPU's
copy engine reads the bytes directly, and with ``non_blocking=True`` the copy overlaps the host's
next work and the GPU's kernels.

- ``batch_bytes`` and ``link_seconds_ref``: the arithmetic, runnable anywhere;
- ``LINKS_GBS``: datasheet bandwidths of common links, one direction;
- ``copy_vs_matmul``: a pageable copy, a pinned asynchronous copy and a matmul on the device,
  timed by the course's harness; a GPU only (there is no copy to time without one).
"""

from __future__ import annotations

import torch

from fastdl_lab import device

# One direction, from the interface specifications: PCIe 3.0 x16 8 GT/s per lane, 4.0 16, 5.0 32,
# with 128b/130b encoding; NVLink-C2C 450 GB/s each way (900 GB/s total).
LINKS_GBS = {"PCIe 3.0 x16": 15.75, "PCIe 4.0 x16": 31.5, "PCIe 5.0 x16": 63.0, "NVLink-C2C (GH200)": 450.0}


def batch_bytes(shape, dtype: torch.dtype) -> int:
    """Bytes of one batch of ``shape`` in ``dtype``."""
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty(0, dtype=dtype).element_size()


def link_seconds_ref(nbytes: int, gbs: float) -> float:
    """The least time ``nbytes`` take over a link of ``gbs`` GB/s (10^9 bytes per second)."""
    if gbs <= 0:
        raise ValueError(f"bandwidth must be positive, got {gbs}")
    return nbytes / (gbs * 1e9)


def copy_vs_matmul(nbytes: int = 256 << 20, matmul_n: int = 4096, dtype: torch.dtype = torch.float16,
                   reps: int = 20) -> dict:
    """Time host-to-device copies of ``nbytes`` (pageable, pinned and asynchronous) and an
    ``matmul_n``-cubed matmul in ``dtype`` on the GPU; GB/s for the copies, TFLOP/s for the matmul."""
    if not device.has_gpu():
        raise RuntimeError("needs a GPU: a host-to-device copy needs a device")
    from fastdl_lab import timing

    elements = nbytes // torch.empty(0, dtype=torch.uint8).element_size()
    pageable = torch.empty(elements, dtype=torch.uint8).random_(0, 256)
    pinned = pageable.pin_memory()
    target = torch.empty(elements, dtype=torch.uint8, device="cuda")
    a = torch.randn(matmul_n, matmul_n, device="cuda", dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device="cuda", dtype=dtype)
    times = {
        "pageable copy": timing.bench(lambda: target.copy_(pageable), reps=reps),
        "pinned copy (non_blocking)": timing.bench(lambda: target.copy_(pinned, non_blocking=True), reps=reps),
        f"matmul {matmul_n}^3 {str(dtype).removeprefix('torch.')}": timing.bench(lambda: a @ b, reps=reps),
    }
    rates = {}
    for name, t in times.items():
        rates[name] = (f"{nbytes / t.median / 1e9:.1f} GB/s" if "copy" in name
                       else f"{2 * matmul_n**3 / t.median / 1e12:.1f} TFLOP/s")
    return {"timings": times, "rates": rates, "bytes": nbytes}
