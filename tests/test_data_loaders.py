"""Lab 06 images and loaders: real JPEGs, draft decoding, augmentation on the host or batched,
deterministic datasets under worker processes, nothing left running, and DataLoader workers
inside the grading sandbox."""

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from fastdl_lab.data import bench, images, loaders

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus():
    return images.jpeg_corpus(24, size=64, seed=0)


def _children() -> list[int]:
    """Live (not yet reaped or still running) child processes of this test process."""
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[1] == me:
            found.append(int(pid))
    return found


def test_sample_jpegs_are_found_and_decode_to_their_shapes():
    samples = dict(images.sample_jpegs())
    assert set(samples) == {"china.jpg", "flower.jpg", "grace_hopper.jpg"}
    shapes = {name: tuple(images.decode_pil(data).shape) for name, data in samples.items()}
    assert shapes == {"china.jpg": (3, 427, 640), "flower.jpg": (3, 427, 640), "grace_hopper.jpg": (3, 600, 512)}
    assert images.decode_pil(samples["china.jpg"]).dtype == torch.uint8


def test_draft_decode_makes_fewer_pixels_but_never_too_few(corpus):
    full = images.decode_pil(corpus[0])
    assert full.shape == (3, 64, 64)
    # libjpeg's scales are 1, 1/2, 1/4, 1/8: the smallest that keeps both sides >= min_size.
    sides = {m: images.decode_pil_draft(corpus[0], m).shape[1] for m in (64, 50, 32, 17, 16, 8, 1)}
    assert sides == {64: 64, 50: 64, 32: 32, 17: 32, 16: 16, 8: 8, 1: 8}
    assert images.decode_pil_draft(corpus[0], 16).shape[1:].numel() * 16 == full.shape[1:].numel()


def test_corpus_is_deterministic_distinct_and_sized():
    a = images.jpeg_corpus(10, size=48, seed=3)
    assert a == images.jpeg_corpus(10, size=48, seed=3)
    assert images.jpeg_corpus(4, size=48, seed=3) == a[:4]
    assert len(set(a)) == 10 and not set(a) & set(images.jpeg_corpus(10, size=48, seed=4))
    assert all(images.decode_pil(d).shape == (3, 48, 48) for d in a)


def test_crop_params_stay_inside_the_image():
    p = images.crop_params(500, 60, 90, torch.Generator().manual_seed(0))
    left, top, w, h, flip = p.unbind(1)
    assert (left >= 0).all() and (top >= 0).all() and (left + w <= 90 + 1e-9).all() and (top + h <= 60 + 1e-9).all()
    area = w * h / (60 * 90)
    assert area.max() <= 1 + 1e-9 and area.min() >= images.CROP_AREA[0] * 0.999
    assert set(flip.tolist()) == {0.0, 1.0}


def test_host_and_batched_augmentation_are_bit_identical(corpus):
    batch = torch.stack([images.decode_pil(d) for d in corpus[:9]])
    one, many = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    host = torch.stack([images.augment_host(img, size=40, generator=one) for img in batch])
    batched = images.augment_batch(batch, size=40, generator=many)
    assert batched.shape == (9, 3, 40, 40) and batched.dtype == torch.float32
    assert torch.equal(host, batched)
    params = images.crop_params(9, 64, 64, torch.Generator().manual_seed(2))
    assert torch.equal(images.augment_batch(batch, size=24, params=params),
                       torch.stack([images.augment_host(img, size=24, params=p) for img, p in zip(batch, params)]))


def test_whole_image_crop_is_the_normalised_image_and_flip_mirrors_it(corpus):
    img = images.decode_pil(corpus[1])
    mean = torch.tensor(images.MEAN).view(3, 1, 1) * 255
    std = torch.tensor(images.STD).view(3, 1, 1) * 255
    expected = (img.float() - mean) / std
    whole = torch.tensor([0.0, 0.0, 64.0, 64.0, 0.0])
    torch.testing.assert_close(images.augment_host(img, size=64, params=whole), expected, rtol=0, atol=1e-5)
    mirrored = torch.tensor([0.0, 0.0, 64.0, 64.0, 1.0])
    torch.testing.assert_close(images.augment_host(img, size=64, params=mirrored), expected.flip(-1), rtol=0, atol=1e-5)
    corner = torch.tensor([16.0, 8.0, 32.0, 32.0, 0.0])
    torch.testing.assert_close(images.augment_host(img, size=32, params=corner), expected[:, 8:40, 16:48],
                               rtol=0, atol=1e-5)


def test_torchvision_decode_says_what_it_needs(corpus):
    tv_io, _ = images._torchvision_io()
    if tv_io is not None:
        pytest.skip("torchvision works here")
    with pytest.raises(RuntimeError, match=r"needs torchvision \(GPU host\)"):
        images.decode_torchvision(corpus[0])


def test_items_depend_on_seed_index_and_epoch_only(corpus):
    ds = loaders.JpegDataset(corpus, size=32, seed=5)
    pre = loaders.PreprocessedDataset(corpus, size=32, seed=5)
    assert pre.images.shape == (24, 3, 64, 64) and pre.images.dtype == torch.uint8
    for i in (0, 7, 23):
        for epoch in (0, 3):
            image, label = ds[i, epoch]
            assert image.shape == (3, 32, 32) and label == i
            assert torch.equal(image, pre[i, epoch][0])
    assert not torch.equal(ds[0, 0][0], ds[0, 1][0])
    assert not torch.equal(ds[0, 0][0], loaders.JpegDataset(corpus, size=32, seed=6)[0, 0][0])
    ds.set_epoch(3)
    assert torch.equal(ds[7][0], ds[7, 3][0])
    draft = loaders.JpegDataset(corpus, size=32, decode="draft")
    assert draft._image(0).shape == (3, 32, 32)
    with pytest.raises(ValueError):
        loaders.JpegDataset(corpus, decode="torchvision")


def _epochs(dataset, epochs: int, **kw) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    loader = DataLoader(dataset, batch_size=5, sampler=loaders.EpochSampler(len(dataset)), **kw)
    out = [list(loader) for _ in range(epochs)]
    del loader
    return out


def _same(a, b) -> bool:
    return all(torch.equal(x, y) and torch.equal(lx, ly)
               for ea, eb in zip(a, b, strict=True) for (x, lx), (y, ly) in zip(ea, eb, strict=True))


def test_workers_give_the_same_batches_as_none(corpus):
    ds = loaders.JpegDataset(corpus, size=24, seed=1)
    reference = _epochs(ds, 2)
    assert _same(reference, _epochs(ds, 2, num_workers=2))
    # Persistent workers never see the main process's dataset again: the sampler carries the epoch.
    assert _same(reference, _epochs(ds, 2, num_workers=2, persistent_workers=True))
    assert not torch.equal(reference[0][0][0], reference[1][0][0])
    assert [int(v) for v in torch.cat([labels for _, labels in reference[0]])] == list(range(24))


def test_shuffled_epochs_are_permutations_fixed_by_seed():
    sampler = loaders.EpochSampler(10, shuffle=True, seed=4)
    first, second = list(sampler), list(sampler)
    assert sorted(i for i, _ in first) == list(range(10)) and {e for _, e in first} == {0} and {e for _, e in second} == {1}
    assert [i for i, _ in first] != [i for i, _ in second]
    assert first == list(loaders.EpochSampler(10, shuffle=True, seed=4))


def test_loader_throughput_counts_and_leaves_no_worker(corpus):
    # Only what this test starts: earlier tests may leave helpers of the test process itself (e.g.
    # multiprocessing's resource tracker, which lives as long as the process).
    before = set(_children())
    ds = loaders.JpegDataset(corpus, size=24)
    result = loaders.loader_throughput(ds, batch_size=4, num_workers=2, persistent_workers=True, batches=3,
                                       epochs=2, threads=1)
    assert set(_children()) <= before
    assert (result["images"], result["batches"], result["num_workers"]) == (24, 6, 2)
    assert result["persistent_workers"] and result["threads"] == 1
    assert result["images_per_s"] > 0 and result["later_first_batch_s"] is not None
    plain = loaders.loader_throughput(ds, batch_size=10, persistent_workers=True, batches=5)
    # Three batches of 10, 10 and 4 are all there are; persistence needs workers.
    assert (plain["images"], plain["batches"], plain["persistent_workers"]) == (24, 3, False)
    assert plain["later_first_batch_s"] is None


def test_sweep_and_its_plot(corpus):
    import matplotlib

    matplotlib.use("Agg")
    before = set(_children())
    ds = loaders.PreprocessedDataset(corpus[:8], size=16)
    configs = [{"num_workers": 0}, {"num_workers": 1}, {"num_workers": 1, "pin_memory": True}]
    rows = loaders.sweep(ds, configs, batch_size=4, batches=2)
    assert [(r["num_workers"], r["pin_memory"], r["images"]) for r in rows] == [(0, False, 8), (1, False, 8), (1, True, 8)]
    ax = loaders.plot_sweep(rows)
    assert len(ax.get_lines()) == 2 and ax.get_xlabel() == "num_workers"
    assert set(_children()) <= before


def test_benchmark_rows_have_one_set_of_columns():
    assert list(bench.row(op="x")) == bench.BENCHMARK["columns"]
    with pytest.raises(KeyError):
        bench.row(op="x", images_per_second=1)
    configs = bench._configs([0, 1, 2, 4])
    # Persistence only with workers, and one row with torch's default threads.
    assert len(configs) == 2 + 3 * 4 + 1
    assert all(c["num_workers"] or not c["persistent_workers"] for c in configs)
    assert bench.ROWS[-2:] == [bench.loop_rows, bench.padding_rows]


SANDBOX_SCRIPT = r"""
import os, sys, torch
from torch.utils.data import DataLoader
from fastdl_lab.data import images, loaders

def pids():
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())

shm = os.statvfs("/dev/shm")
print("shm bytes", shm.f_blocks * shm.f_frsize)
tmp = os.statvfs("/tmp")
print("tmp bytes", tmp.f_blocks * tmp.f_frsize)
dataset = loaders.JpegDataset(images.jpeg_corpus(16, size=48, seed=2), size=24, seed=9)
loader = DataLoader(dataset, batch_size=4, sampler=loaders.EpochSampler(16), num_workers=2, persistent_workers=True)
batches, during = [], []
for epoch in range(2):
    for x, y in loader:
        batches.append((x, y))
        during.append(len(pids()))
# The last reference to a loader with persistent workers: its iterator shuts them down now.
del loader
torch.save(batches, "/job/batches.pt")
print("processes during", max(during), "after", len(pids()))
"""


def test_workers_run_inside_the_grading_sandbox(tmp_path):
    from autograder import profiles
    from autograder.engine import bwrap, grade
    from autograder.engine.items import Item
    from autograder.engine.sandbox import run_sandboxed
    from autograder.strip import strip_package

    bwrap.check()
    student = tmp_path / "student_package"
    strip_package(ROOT / "fastdl_lab", student / "fastdl_lab")
    work = tmp_path / "job"
    work.mkdir()
    (work / "script.py").write_text(SANDBOX_SCRIPT)
    bwrap.prepare_workdir(str(work))
    # The limits, environment and view of an item child of the CPU profile, as grade._run_child
    # builds them; the script replaces the engine's child module.
    profile = profiles.load("cpu")
    sandbox = grade.Sandbox(student, profile)
    limits = grade._item_limits(Item("loader", 1.0, (), lambda seed, params: {}), profile)
    view = bwrap.View(str(work), read_only={str(student): bwrap.STUDENT_DIR,
                                            str(ROOT / "autograder"): f"{grade.GRADER_DIR}/autograder"})
    marker = f"fastdl-loader-sandbox-{os.getpid()}"
    result = run_sandboxed([bwrap.PYTHON, f"{bwrap.JOB}/script.py", marker], limits=limits, cwd=str(work),
                           env=grade._child_env(sandbox, str(work)), view=view)
    assert result.status == "ok" and result.sandboxed, result.output_tail[-2000:]
    # Both tmpfs mounts are capped: what is parked there is memory no resident-set limit sees.
    assert f"shm bytes {bwrap.SHM_BYTES}" in result.output_tail
    assert f"tmp bytes {bwrap.TMP_BYTES}" in result.output_tail
    # bubblewrap's init, the script and its two workers while loading; only the first two after.
    assert "processes during 4 after 2" in result.output_tail, result.output_tail[-500:]
    sandboxed = torch.load(work / "batches.pt", weights_only=True)
    local = DataLoader(loaders.JpegDataset(images.jpeg_corpus(16, size=48, seed=2), size=24, seed=9), batch_size=4,
                       sampler=loaders.EpochSampler(16))
    assert _same([sandboxed], [list(local) + list(local)])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            assert marker.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            pass
