"""Host-to-device copies: what feeding a GPU costs against computing on it (lab 06 data).

Every batch crosses the link between host and GPU (PCIe, or NVLink-C2C on a Grace Hopper) before
the GPU can use it. From ordinary, *pageable* host memory the driver first copies the bytes into a
pinned staging buffer and the copy blocks the host; from *pinned* (page-locked) memory the GPU's
copy engine reads the bytes directly, and with ``non_blocking=True`` the copy overlaps the host's
next work and the GPU's kernels.

- ``batch_bytes`` and ``link_seconds_ref``: the arithmetic, runnable anywhere;
- ``LINKS_GBS``: datasheet bandwidths of common links, one direction;
- ``copy_vs_matmul``: a pageable copy, a pinned asynchronous copy and a matmul on the device,
  timed by the course's harness; a GPU only (there is no copy to time without one);
- ``latency_ladder``: what the smallest unit of each kind of work costs on this machine, from a
  Python call to a round trip to the GPU, each measured here (GPU rungs: None without one).
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


def _python_call_s(reps: int) -> float:
    import timeit

    def nothing():
        return None

    number = 100_000
    return min(timeit.repeat(nothing, number=number, repeat=max(reps, 3))) / number


def latency_ladder(reps: int = 10) -> list[dict]:
    """One rung per kind of small work, each the median of ``reps`` samples measured on this
    machine: ``{"what", "seconds", "why"}``, ``seconds`` None where the rung needs a GPU.

    The rungs: a Python call; one torch op on a one-element CPU tensor (the dispatcher's fixed
    cost); copying 4 KiB and 64 MiB within host memory; and on a GPU, launching a one-element op
    (host clock, no wait), the same op followed by ``.item()`` (a launch, the kernel, a copy back and
    the host's wait: a synchronisation) and a pinned 4-byte host-to-device copy waited for. Small
    work is all fixed cost: the rungs show how many bytes or FLOPs each fixed cost is worth.
    """
    from fastdl_lab import timing

    one = torch.ones(1)
    small_src, small_dst = torch.ones(1024), torch.empty(1024)          # 4 KiB of fp32
    big_src, big_dst = torch.ones(16 << 20), torch.empty(16 << 20)      # 64 MiB
    rungs = [
        {"what": "a Python function call", "seconds": _python_call_s(reps),
         "why": "the interpreter's own cost per call"},
        {"what": "one torch op on a 1-element CPU tensor", "seconds": timing.bench(lambda: one + one, reps=reps).median,
         "why": "the dispatcher and allocator, with almost no arithmetic"},
        {"what": "copy 4 KiB in host memory", "seconds": timing.bench(lambda: small_dst.copy_(small_src),
                                                                        reps=reps).median,
         "why": "a torch op's fixed cost plus a little bandwidth"},
        {"what": "copy 64 MiB in host memory", "seconds": timing.bench(lambda: big_dst.copy_(big_src),
                                                                         reps=reps).median,
         "why": "bandwidth: DRAM read and write"},
    ]
    gpu = device.has_gpu()
    if gpu:
        g = torch.ones(1, device="cuda")
        pinned, target = torch.ones(1).pin_memory(), torch.empty(1, device="cuda")

        def copy_and_wait():
            target.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

    gpu_rungs = [
        ("launch a 1-element op on the GPU (host clock, no wait)", lambda: g + g, False,
         "what the host pays per launch; the GPU runs it later"),
        ("a 1-element op then .item() (a synchronisation)", lambda: (g + g).item(), True,
         "launch, kernel, copy back, and the host waiting for all of it"),
        ("a pinned 4-byte host-to-device copy, waited for", lambda: copy_and_wait(), True,
         "the link's latency, not its bandwidth"),
    ]
    for what, fn, sync, why in gpu_rungs:
        seconds = timing.bench(fn, reps=reps, sync=sync).median if gpu else None
        rungs.append({"what": what, "seconds": seconds, "why": why if gpu else "needs a GPU"})
    return rungs
