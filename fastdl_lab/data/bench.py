"""Benchmark spec and self-check of lab 06's data pipeline; ``benchmarks/data.py`` runs them.

Every row comes from a function in ``ROWS`` that takes the log and returns rows made by ``row``
(one fixed set of columns, so another module's measurements append to the same CSV: add its
function to ``ROWS``). The rows:

- decoding a JPEG: PIL at full size against PIL's draft mode (and torchvision's nvJPEG decoder on a
  GPU host), with the pixels each one produces;
- augmenting per image, as a worker does, against one batched call, with the bytes a host-to-device
  copy would move for each (uint8 before augmenting, float32 after);
- the CPU cost of one item: decode + augment, draft decode + augment, augment alone;
- DataLoader images/s for num_workers x pin_memory x persistent_workers, A/B interleaved runs;
- pre-processing once against decoding every epoch;
- the planted training loop against the fixed one: time per step, syncs, ops and uploads per step;
- padding fractions of padding to the maximum, random batches, bucketing and packing.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

import torch

from fastdl_lab import device
from fastdl_lab.data import images, loaders

BENCHMARK = {
    "name": "data",
    "cpu": {"corpus": 256, "jpeg_size": 256, "size": 128, "batch_size": 32, "batches": 10, "epochs": 2,
            "workers": [0, 1, 2, 4], "runs": 3, "reps": 10},
    "gpu": {"corpus": 1024, "jpeg_size": 512, "size": 224, "batch_size": 64, "batches": 16, "epochs": 2,
            "workers": [0, 2, 4, 8], "runs": 3, "reps": 20},
    # nvJPEG decoding and augmenting on the device after a uint8 copy exist only on a GPU host.
    "gpu_only": ["decode torchvision", "augment batched on the device"],
    "columns": ["op", "variant", "size", "batch_size", "num_workers", "pin_memory", "persistent_workers",
                "threads", "median_s", "iqr_s", "items_per_s", "first_batch_s", "later_first_batch_s", "speedup",
                "ci_low", "ci_high", "figure", "unit", "note"],
}

NEEDS_GPU = "needs a GPU"
Log = Callable[[str], None]


def row(**values) -> dict:
    """One result row with every column of ``BENCHMARK["columns"]``; an unknown name is an error."""
    unknown = set(values) - set(BENCHMARK["columns"])
    if unknown:
        raise KeyError(f"not a column of the data benchmark: {sorted(unknown)}")
    return {name: values.get(name) for name in BENCHMARK["columns"]}


def _spec() -> dict:
    return BENCHMARK["gpu" if device.has_gpu() else "cpu"]


def _corpus(spec: dict) -> list[bytes]:
    return images.jpeg_corpus(spec["corpus"], size=spec["jpeg_size"], seed=0)


def decode_rows(log: Log) -> list[dict]:
    """Seconds per JPEG and pixels produced: full decode, draft to the training size and to half it."""
    from fastdl_lab import timing

    spec = _spec()
    jpegs, size = _corpus(spec)[: spec["batch_size"]], spec["size"]
    n, side = len(jpegs), spec["jpeg_size"]
    full = timing.bench(lambda: [images.decode_pil(d) for d in jpegs], warmup=1, reps=spec["reps"], threads=1)
    rows = [row(op="decode", variant="pil", size=side, threads=1, median_s=full.median / n, iqr_s=full.iqr / n,
                items_per_s=n / full.median, speedup=1.0, figure=side * side, unit="pixels per image")]
    log(f"decode pil {side}x{side}: {full.median / n * 1e3:.2f} ms per image")
    for target in (size, size // 2):
        pixels = images.decode_pil_draft(jpegs[0], target).shape[1:].numel()
        cmp = timing.compare(lambda t=target: [images.decode_pil_draft(d, t) for d in jpegs],
                             lambda: [images.decode_pil(d) for d in jpegs], warmup=1, reps=spec["reps"], threads=1)
        rows.append(row(op="decode", variant=f"pil_draft min_size={target}", size=side, threads=1,
                        median_s=cmp.candidate.median / n, iqr_s=cmp.candidate.iqr / n,
                        items_per_s=n / cmp.candidate.median, speedup=cmp.speedup, ci_low=cmp.ci_low,
                        ci_high=cmp.ci_high, figure=pixels, unit="pixels per image"))
        log(f"decode draft >= {target}: {pixels} pixels ({side * side / pixels:.0f}x fewer), "
            f"{cmp.candidate.median / n * 1e3:.2f} ms per image, {cmp.speedup:.2f}x pil")
    rows.append(_torchvision_decode_row(jpegs, side, spec, full.median / n, log))
    return rows


def _torchvision_decode_row(jpegs: list[bytes], side: int, spec: dict, pil_s: float, log: Log) -> dict:
    from fastdl_lab import timing

    if not device.has_gpu():
        log(f"decode torchvision (nvJPEG): {NEEDS_GPU}")
        return row(op="decode", variant="torchvision cuda", size=side, note=NEEDS_GPU)
    try:
        images.decode_torchvision(jpegs[:1])
    except RuntimeError as exc:
        log(f"decode torchvision: {exc}")
        return row(op="decode", variant="torchvision cuda", size=side, note=images.NEEDS_TORCHVISION)
    n = len(jpegs)
    t = timing.bench(lambda: images.decode_torchvision(jpegs, "cuda"), warmup=3, reps=spec["reps"])
    log(f"decode torchvision nvJPEG, batch of {n}: {t.median / n * 1e6:.0f} us per image")
    return row(op="decode", variant="torchvision cuda", size=side, batch_size=n, median_s=t.median / n,
               iqr_s=t.iqr / n, items_per_s=n / t.median, speedup=pil_s / (t.median / n),
               figure=side * side, unit="pixels per image")


def augment_rows(log: Log) -> list[dict]:
    """Per-image augmentation against one batched call on the same draws, one thread each."""
    from fastdl_lab import timing

    spec = _spec()
    size, b = spec["size"], spec["batch_size"]
    batch = torch.stack([images.decode_pil(d) for d in _corpus(spec)[:b]])
    params = images.crop_params(b, batch.shape[2], batch.shape[3], torch.Generator().manual_seed(0))

    def per_image():
        return torch.stack([images.augment_host(img, size=size, params=p) for img, p in zip(batch, params)])

    cmp = timing.compare(lambda: images.augment_batch(batch, size=size, params=params), per_image,
                         warmup=1, reps=spec["reps"], threads=1)
    # What would cross the bus: float32 results when the host augments, uint8 pixels otherwise.
    float_bytes, uint8_bytes = b * 3 * size * size * 4, batch.numel()
    common = {"op": "augment", "size": size, "batch_size": b, "unit": "bytes to copy to the device"}
    rows = [row(**common, variant="per image (host)", threads=1, median_s=cmp.baseline.median,
                iqr_s=cmp.baseline.iqr, items_per_s=b / cmp.baseline.median, speedup=1.0, figure=float_bytes),
            row(**common, variant="batched (host)", threads=1, median_s=cmp.candidate.median,
                iqr_s=cmp.candidate.iqr, items_per_s=b / cmp.candidate.median, speedup=cmp.speedup,
                ci_low=cmp.ci_low, ci_high=cmp.ci_high, figure=uint8_bytes)]
    log(f"augment {b} images to {size}: per image {cmp.baseline.median * 1e3:.1f} ms, batched "
        f"{cmp.candidate.median * 1e3:.1f} ms ({cmp.speedup:.2f}x); copy {float_bytes >> 10} KiB float32 "
        f"or {uint8_bytes >> 10} KiB uint8")
    if not device.has_gpu():
        log(f"augment batched on the device: {NEEDS_GPU}")
        return rows + [row(**common, variant="batched (device, with uint8 copy)", figure=uint8_bytes,
                           note=NEEDS_GPU)]
    pinned = batch.pin_memory()
    on_device = timing.bench(lambda: images.augment_batch(pinned.to("cuda", non_blocking=True), size=size,
                                                          params=params), warmup=3, reps=spec["reps"])
    log(f"augment batched on the device, copy included: {on_device.median * 1e3:.2f} ms")
    return rows + [row(**common, variant="batched (device, with uint8 copy)", median_s=on_device.median,
                       iqr_s=on_device.iqr, items_per_s=b / on_device.median,
                       speedup=cmp.baseline.median / on_device.median, figure=uint8_bytes)]


def item_rows(log: Log) -> list[dict]:
    """What one ``__getitem__`` costs a worker (one thread), by what it does."""
    from fastdl_lab import timing

    spec = _spec()
    jpegs, size = _corpus(spec)[: spec["batch_size"]], spec["size"]
    n = len(jpegs)
    datasets = {"decode + augment": loaders.JpegDataset(jpegs, size=size),
                "draft decode + augment": loaders.JpegDataset(jpegs, size=size, decode="draft"),
                "augment only (preprocessed)": loaders.PreprocessedDataset(jpegs, size=size)}
    rows = []
    for variant, ds in datasets.items():
        t = timing.bench(lambda ds=ds: [ds[i] for i in range(n)], warmup=1, reps=spec["reps"], threads=1)
        rows.append(row(op="item", variant=variant, size=size, threads=1, median_s=t.median / n, iqr_s=t.iqr / n,
                        items_per_s=n / t.median))
        log(f"item, {variant}: {t.median / n * 1e3:.2f} ms")
    base = rows[0]["median_s"]
    for r in rows:
        r["speedup"] = base / r["median_s"]
    return rows


def _configs(workers: list[int]) -> list[dict]:
    # Persistence means nothing without workers: zero workers appears once per pin setting.
    # Items made in this process get one intra-op thread, as every worker does, so that the
    # rows differ in the DataLoader's settings only; one more row keeps torch's default.
    configs = [{"num_workers": w, "pin_memory": pin, "persistent_workers": persistent, "threads": 1}
               for w in workers for pin in (False, True) for persistent in (False, True) if w or not persistent]
    return configs + [{"num_workers": 0, "pin_memory": False, "persistent_workers": False, "threads": None}]


def loader_rows(log: Log) -> list[dict]:
    """Images/s of a DataLoader over ``JpegDataset`` for every setting, runs interleaved."""
    from fastdl_lab import timing

    spec = _spec()
    dataset = loaders.JpegDataset(_corpus(spec), size=spec["size"])
    configs = _configs(spec["workers"])
    kw = {"batch_size": spec["batch_size"], "batches": spec["batches"], "epochs": spec["epochs"]}
    # Every config once per round rather than all runs of one in a row: load from the machine's
    # other tenants then falls on every config alike.
    runs = [loaders.sweep(dataset, configs, **kw) for _ in range(spec["runs"])]
    rows = []
    for i, config in enumerate(configs):
        mine = [r[i] for r in runs]
        wall = timing.Timing([r["wall_s"] for r in mine])
        first = statistics.median(r["first_batch_s"] for r in mine)
        later = statistics.median(r["later_first_batch_s"] for r in mine)
        unpinned = config["pin_memory"] and not mine[0]["pinned"]
        rows.append(row(op="loader", variant="JpegDataset", size=spec["size"], batch_size=spec["batch_size"],
                        **{**config, "threads": mine[0]["threads"]}, median_s=wall.median, iqr_s=wall.iqr,
                        items_per_s=mine[0]["images"] / wall.median, first_batch_s=first,
                        later_first_batch_s=later, figure=mine[0]["images"], unit="images per run",
                        note="pin_memory asked, but no accelerator: batches not pinned" if unpinned else ""))
        log(f"loader workers={config['num_workers']} pin={config['pin_memory']!s:5} "
            f"persistent={config['persistent_workers']!s:5} threads={mine[0]['threads']}: "
            f"{rows[-1]['items_per_s']:6.0f} images/s, first batch {first * 1e3:4.0f} ms, "
            f"later epochs' first {later * 1e3:4.0f} ms")
    base = rows[0]["items_per_s"]
    for r in rows:
        r["speedup"] = r["items_per_s"] / base
    return rows


def preprocess_rows(log: Log) -> list[dict]:
    """Decoding every epoch against decoding once: per-epoch rate, the one-off cost, the memory."""
    spec = _spec()
    jpegs = _corpus(spec)
    kw = {"batch_size": spec["batch_size"], "batches": len(jpegs), "epochs": spec["epochs"], "threads": 1}
    pre = loaders.PreprocessedDataset(jpegs, size=spec["size"])
    every = loaders.loader_throughput(loaders.JpegDataset(jpegs, size=spec["size"]), **kw)
    once = loaders.loader_throughput(pre, **kw)
    resident = pre.images.numel() * pre.images.element_size()
    epochs = every["epochs"]
    log(f"{epochs} epochs of {len(jpegs)} images: decode every epoch {every['images_per_s']:.0f} images/s, "
        f"preprocessed {once['images_per_s']:.0f} images/s after a one-off {pre.decode_s:.2f} s decode "
        f"holding {resident >> 20} MiB")
    common = {"op": "preprocess", "size": spec["size"], "batch_size": spec["batch_size"], "num_workers": 0,
              "threads": 1}
    return [row(**common, variant=f"decode every epoch ({epochs} epochs)", median_s=every["wall_s"],
                items_per_s=every["images_per_s"], speedup=1.0, figure=len(jpegs) * epochs, unit="decodes"),
            row(**common, variant=f"preprocessed ({epochs} epochs)", median_s=once["wall_s"],
                items_per_s=once["images_per_s"], speedup=every["wall_s"] / once["wall_s"], figure=resident,
                unit="bytes held decoded"),
            row(**common, variant="preprocess: decode all once", median_s=pre.decode_s,
                speedup=every["wall_s"] / (once["wall_s"] + pre.decode_s), figure=len(jpegs), unit="decodes")]


def loop_rows(log: Log) -> list[dict]:
    """The planted loop against the fixed one on real docstrings: A/B times, and per step the syncs,
    ops and uploads ``SyncCounter`` sees (the fixed loop with a single-process loader too, which
    separates the loop's own fixes from the loader's)."""
    from torch.utils.data import DataLoader

    from fastdl_lab import timing
    from fastdl_lab.data import loop, text
    from fastdl_lab.data.syncs import SyncCounter

    spec, dev = _spec(), "cuda" if device.has_gpu() else "cpu"
    steps, batch = 2 * spec["batches"], spec["batch_size"]
    dataset = loop.make_dataset(text.corpus(steps * batch, seed=0, max_len=256))

    def slow():
        model, optimizer = loop.fresh_run(0, device=dev)
        loop.train_slow(model, optimizer, dataset, steps=steps, batch_size=batch, seed=0, device=dev)

    def fast(workers: bool):
        model, optimizer = loop.fresh_run(0, device=dev)
        loader = (loop.make_loader(dataset, batch_size=batch, seed=0, device=dev) if workers else
                  DataLoader(dataset, batch_size=batch, sampler=loop.shuffle_sampler(dataset, 0),
                             collate_fn=text.pad_collate))
        loop.train_fast(model, optimizer, loader, steps=steps, device=dev)

    variants = {"train_slow": (slow, 0), "train_fast, one process": (lambda: fast(False), 0),
                "train_fast + make_loader": (lambda: fast(True), 2)}
    rows = []
    for name, (fn, workers) in variants.items():
        common = dict(op="loop", variant=name, size=256, batch_size=batch, num_workers=workers)
        if fn is slow:
            timed = timing.bench(slow, warmup=1, reps=spec["runs"])
            rows.append(row(**common, median_s=timed.median / steps, iqr_s=timed.iqr / steps, speedup=1.0,
                            figure=steps, unit="steps"))
        else:
            cmp = timing.compare(fn, slow, warmup=1, reps=spec["runs"])
            rows.append(row(**common, median_s=cmp.candidate.median / steps, iqr_s=cmp.candidate.iqr / steps,
                            speedup=cmp.speedup, ci_low=cmp.ci_low, ci_high=cmp.ci_high, figure=steps, unit="steps"))
        with SyncCounter(device=dev) as counts:
            fn()
        for unit, count in (("syncs", counts.syncs), ("ops", counts.ops), ("uploads", counts.uploads)):
            rows.append(row(**{**common, "op": "loop counts"}, figure=count / steps, unit=f"{unit} per step"))
        timed = rows[-4]
        log(f"{name}: {timed['median_s'] * 1e3:.2f} ms per step ({timed['speedup']:.2f}x train_slow), "
            f"{counts.syncs / steps:.1f} syncs, {counts.ops / steps:.0f} ops, {counts.uploads / steps:.1f} uploads per step")
    return rows


def padding_rows(log: Log) -> list[dict]:
    """Padding fraction of the four batchings on every stdlib docstring, cut at 256 tokens (batch 32)."""
    from fastdl_lab.data import text

    report = text.padding_report(text.docstring_lengths(), 32, 0, 256)
    log("padding: " + ", ".join(f"{name} {fraction:.1%}" for name, fraction in report.items()))
    return [row(op="padding", variant=name, size=256, batch_size=32, figure=fraction, unit="padding fraction")
            for name, fraction in report.items()]


# Row-producing functions, run in this order; append another module's to record its rows here.
ROWS: list[Callable[[Log], list[dict]]] = [decode_rows, augment_rows, item_rows, loader_rows, preprocess_rows,
                                           loop_rows, padding_rows]


def _machine_note() -> str:
    if device.has_gpu():
        return ""
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} CPU cores shared with other processes (load average {load:.1f} at start)"


def benchmark(log: Log = print) -> list[dict]:
    """Every row this machine can measure; one dict per row of ``benchmarks/results/data.csv``."""
    note = _machine_note()
    rows = []
    for produce in ROWS:
        rows += produce(log)
    for r in rows:
        r["note"] = "; ".join(part for part in (r.get("note"), note) if part)
    return rows


def check() -> None:
    """Shapes of real decodes, the draft's pixel saving, host and batched augmentation equal bit
    for bit, the two datasets equal item for item, and items that change between epochs."""
    samples = images.sample_jpegs()
    for name, data in samples:
        img = images.decode_pil(data)
        assert img.dtype == torch.uint8 and img.dim() == 3 and img.shape[0] == 3, (name, img.shape)
    jpegs = images.jpeg_corpus(12, size=96, seed=1)
    assert jpegs == images.jpeg_corpus(12, size=96, seed=1) and len(set(jpegs)) == 12
    assert images.decode_pil_draft(jpegs[0], 24).shape == (3, 24, 24)
    batch = torch.stack([images.decode_pil(d) for d in jpegs])
    one, many = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    host = torch.stack([images.augment_host(img, size=40, generator=one) for img in batch])
    assert torch.equal(images.augment_batch(batch, size=40, generator=many), host)
    if device.has_gpu():
        on_device = images.augment_batch(batch.cuda(), size=40, generator=torch.Generator().manual_seed(5))
        torch.testing.assert_close(on_device.cpu(), host, rtol=1e-4, atol=1e-3)
    jpeg_ds, pre_ds = loaders.JpegDataset(jpegs, size=40, seed=3), loaders.PreprocessedDataset(jpegs, size=40, seed=3)
    assert all(torch.equal(jpeg_ds[i, 1][0], pre_ds[i, 1][0]) for i in range(len(jpegs)))
    assert not torch.equal(jpeg_ds[0, 0][0], jpeg_ds[0, 1][0]), "an item must change between epochs"
    print(f"data: checks passed ({len(samples)} sample JPEGs: {', '.join(n for n, _ in samples)}; "
          f"host and batched augmentation identical)")
