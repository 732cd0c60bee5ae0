"""Datasets with a real per-item cost, and what DataLoader settings do to their throughput (lab 06 data).

- ``JpegDataset``: every item is a JPEG decode plus a random resized crop, flip and normalise,
  the per-item CPU work of an image classification input pipeline;
- ``PreprocessedDataset``: the same images decoded once up front, so an item only augments;
- ``EpochSampler``: indices tagged with their epoch, which is how a worker process learns the
  epoch when it is persistent and never sees the main process's dataset object again;
- ``loader_throughput``, ``sweep`` and ``plot_sweep``: images per second and time to the first
  batch for num_workers, pin_memory, prefetch_factor and persistent_workers.

Randomness is per item, never per process: item ``index`` of epoch ``epoch`` draws from its own
generator seeded by (seed, index, epoch). A dataset that drew from a global RNG would give every
forked worker a copy of the same state (the classic duplicated-augmentation bug) and a result
that depends on which worker an item landed on; here it does not matter which process runs an
item, so any number of workers yields the same batches as none.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fastdl_lab.data.images import augment_host, decode_pil, decode_pil_draft

DECODERS = ("pil", "draft")


def _generator(*entropy: int) -> torch.Generator:
    # SeedSequence mixes the numbers properly: seed + index would collide across epochs.
    state = np.random.SeedSequence(list(entropy)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def item_generator(seed: int, index: int, epoch: int) -> torch.Generator:
    """A generator that belongs to one item of one epoch, the same in whatever process asks."""
    return _generator(seed, index, epoch)


def _key(key, default_epoch: int) -> tuple[int, int]:
    if isinstance(key, tuple):
        index, epoch = key
        return int(index), int(epoch)
    return int(key), default_epoch


class _AugmentedImages(Dataset):
    """What both datasets share: labels, the epoch, and the augmentation of one item."""

    def __init__(self, n: int, *, size: int, seed: int, labels: Sequence[int] | None):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{len(labels)} labels for {n} images")
        self.size, self.seed = size, seed
        self.labels = list(range(n)) if labels is None else [int(v) for v in labels]
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.labels)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of plain integer indices. Reaches workers only when they are started anew
        for each epoch: persistent workers keep the copy they were forked with, so use an
        ``EpochSampler`` with them."""
        self.epoch = epoch

    def _augment(self, image: torch.Tensor, index: int, epoch: int) -> torch.Tensor:
        return augment_host(image, size=self.size, generator=item_generator(self.seed, index, epoch))

    def _image(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        """``dataset[i]`` (epoch from ``set_epoch``) or ``dataset[i, epoch]`` -> (image, label)."""
        index, epoch = _key(key, self.epoch)
        return self._augment(self._image(index), index, epoch), self.labels[index]


class JpegDataset(_AugmentedImages):
    """JPEG bytes in memory; each item decodes and augments: float [3, size, size] and a label.

    ``decode="draft"`` lets libjpeg decode at the smallest power-of-two scale that keeps both
    sides at least ``size``, trading detail in upscaled small crops for a cheaper decode.
    Labels default to each item's index, so a batch says which items it holds.
    """

    def __init__(self, jpegs: list[bytes], *, size: int = 128, seed: int = 0, decode: str = "pil",
                 labels: Sequence[int] | None = None):
        if decode not in DECODERS:
            raise ValueError(f"decode must be one of {DECODERS}, got {decode!r} (a GPU decoder takes "
                             "whole batches in the main process, not items in workers)")
        super().__init__(len(jpegs), size=size, seed=seed, labels=labels)
        self.jpegs, self.decode = jpegs, decode

    def _image(self, index: int) -> torch.Tensor:
        data = self.jpegs[index]
        return decode_pil(data) if self.decode == "pil" else decode_pil_draft(data, self.size)


class PreprocessedDataset(_AugmentedImages):
    """The same images decoded once, here, into one uint8 [N, 3, H, W] tensor; items only augment.

    Decoding is deterministic, so item (index, epoch) equals ``JpegDataset``'s for the same seed
    and decoder: only where the decode happens, and how often, differs. ``decode_s`` is what the
    one pass cost. Workers forked later share the tensor's pages instead of copying them.
    """

    def __init__(self, jpegs: list[bytes], *, size: int = 128, seed: int = 0, decode: str = "pil",
                 labels: Sequence[int] | None = None):
        super().__init__(len(jpegs), size=size, seed=seed, labels=labels)
        source = JpegDataset(jpegs, size=size, seed=seed, decode=decode)
        start = time.perf_counter()
        decoded = [source._image(i) for i in range(len(jpegs))]
        shapes = {tuple(image.shape) for image in decoded}
        if len(shapes) > 1:
            raise ValueError(f"images of different shapes {sorted(shapes)} cannot share one tensor")
        self.images = torch.stack(decoded) if decoded else torch.empty(0, 3, size, size, dtype=torch.uint8)
        self.decode_s = time.perf_counter() - start

    def _image(self, index: int) -> torch.Tensor:
        return self.images[index]


class EpochSampler(Sampler):
    """Yields (index, epoch) pairs, counting its own epochs: one per ``iter``.

    The sampler lives in the main process and its indices travel to the workers with every
    batch, so the epoch reaches persistent workers too. ``shuffle`` orders each epoch by a
    permutation seeded by (seed, epoch).
    """

    def __init__(self, n: int, *, shuffle: bool = False, seed: int = 0, start_epoch: int = 0):
        self.n, self.shuffle, self.seed, self.epoch = n, shuffle, seed, start_epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        if self.shuffle:
            order = torch.randperm(self.n, generator=_generator(self.seed, epoch))
        else:
            order = torch.arange(self.n)
        return iter([(int(i), epoch) for i in order])


def _shut_down(iterator) -> None:
    # DataLoader has no public close. Its multiprocessing iterator joins (or kills) its workers
    # in _shutdown_workers, which otherwise runs only when the garbage collector gets to the
    # iterator: call it now so that no worker outlives the measurement.
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def loader_throughput(dataset: Dataset, *, batch_size: int = 32, num_workers: int = 0, pin_memory: bool = False,
                      prefetch_factor: int | None = None, persistent_workers: bool = False, batches: int = 20,
                      epochs: int = 1, threads: int | None = None) -> dict:
    """Images per second through a DataLoader over ``batches`` batches of each of ``epochs``.

    Timed by the wall clock from ``iter(loader)`` to the last batch of each epoch. That is the
    honest figure for a pipeline of processes: workers run ahead of the consumer, so timing one
    ``next()`` would time a queue pop; and what a training loop waits for includes starting
    the workers, which is what persistent workers save from the second epoch on. The timing
    harness's repeated calls cannot express either. ``first_batch_s`` is epoch 0's wait for its
    first batch and ``later_first_batch_s`` the median of the other epochs'.

    ``threads`` sets torch's intra-op threads of this process for the call (workers always run
    one each). It matters with ``num_workers=0``, where items are made here: on a machine whose
    cores are busy, several threads on small per-image ops wait for each other far longer than
    the ops take.
    """
    if batches < 1 or epochs < 1:
        raise ValueError(f"need batches >= 1 and epochs >= 1, got {batches}, {epochs}")
    persistent = persistent_workers and num_workers > 0
    sampler = EpochSampler(len(dataset)) if isinstance(dataset, _AugmentedImages) else None
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                        pin_memory=pin_memory, prefetch_factor=prefetch_factor if num_workers else None,
                        persistent_workers=persistent)
    per_epoch = min(batches, len(loader))
    first, images, pinned = [], 0, False
    iterator = None
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used_threads = torch.get_num_threads()
    start = time.perf_counter()
    try:
        for _ in range(epochs):
            epoch_start = time.perf_counter()
            iterator = iter(loader)
            for b in range(per_epoch):
                x, _ = next(iterator)
                if b == 0:
                    first.append(time.perf_counter() - epoch_start)
                    pinned = pinned or x.is_pinned()
                images += x.shape[0]
        wall = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous_threads)
        _shut_down(iterator)
        del iterator, loader
    return {
        "batch_size": batch_size, "num_workers": num_workers, "pin_memory": pin_memory, "pinned": pinned,
        "prefetch_factor": prefetch_factor, "persistent_workers": persistent, "threads": used_threads, "epochs": epochs,
        "batches": per_epoch * epochs, "images": images, "wall_s": wall, "images_per_s": images / wall,
        "first_batch_s": first[0],
        "later_first_batch_s": float(np.median(first[1:])) if len(first) > 1 else None,
    }


def sweep(dataset: Dataset, configs: list[dict], **kw) -> list[dict]:
    """``loader_throughput`` for each config (its keys override ``kw``), one row each."""
    return [loader_throughput(dataset, **{**kw, **config}) for config in configs]


def plot_sweep(rows: list[dict], ax=None):
    """Images/s against num_workers, one line per (pin_memory, persistent_workers) setting."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    lines: dict[tuple[bool, bool], list[tuple[int, float]]] = {}
    for row in rows:
        lines.setdefault((row["pin_memory"], row["persistent_workers"]), []).append(
            (row["num_workers"], row["images_per_s"]))
    for (pin, persistent), points in sorted(lines.items()):
        points.sort()
        ax.plot([w for w, _ in points], [v for _, v in points], marker="o",
                label=f"pin_memory={pin}, persistent_workers={persistent}")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("images / s")
    ax.set_xticks(sorted({row["num_workers"] for row in rows}))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return ax
