"""Decoding JPEGs and augmenting images, one at a time on the host or as a batch (lab 06 data).

- ``sample_jpegs``: real photographs that ship inside scikit-learn and matplotlib (no download);
- ``jpeg_corpus``: any number of distinct JPEGs cut from them, so every item costs a real decode;
- ``decode_pil`` (the reference), ``decode_pil_draft`` (libjpeg scales in the DCT domain, a cheaper
  decode when the image will be shrunk anyway) and ``decode_torchvision`` (nvJPEG on a GPU host);
- ``crop_params``, ``augment_host`` and ``augment_batch``: a random resized crop, a horizontal flip
  and normalisation, per image as a DataLoader worker would run it, or for a whole batch in a few
  tensor ops as the device would after copying uint8 pixels. Both apply the same parameters
  through the same sampling, so one draw gives bit-identical images either way.

torchvision is imported only inside ``decode_torchvision``: its CPU-only builds fail against
this torch, and importing this module must never depend on it.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

# Where the photographs live inside their packages; found through the import system, not a path.
SAMPLES = (
    ("sklearn", "datasets/images/china.jpg"),
    ("sklearn", "datasets/images/flower.jpg"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
)
# ImageNet channel statistics, the normalisation almost every pretrained vision model expects.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
# Random resized crop: fraction of the image's area kept, and the range of aspect ratios.
CROP_AREA = (0.25, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
NEEDS_TORCHVISION = "needs torchvision (GPU host)"


def sample_jpegs() -> list[tuple[str, bytes]]:
    """(file name, JPEG bytes) of each sample photograph, read from the installed packages."""
    found = []
    for package, relative in SAMPLES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"{package} is not installed: its sample image {relative} is needed")
        path = Path(next(iter(spec.submodule_search_locations))) / relative
        found.append((path.name, path.read_bytes()))
    return found


@functools.cache
def _sample_images() -> tuple[Image.Image, ...]:
    # Decoded once per process: the corpus cuts many crops out of the same three photographs.
    return tuple(Image.open(io.BytesIO(data)).convert("RGB") for _, data in sample_jpegs())


def jpeg_corpus(n: int, *, size: int = 256, seed: int = 0) -> list[bytes]:
    """``n`` distinct ``size`` x ``size`` JPEGs: random square crops of the samples, resized and
    re-encoded at qualities from 60 to 95. The same seed gives the same bytes."""
    if n < 0 or size < 8:
        raise ValueError(f"need n >= 0 and size >= 8, got n={n}, size={size}")
    sources = _sample_images()
    rng = np.random.default_rng(seed)
    corpus, seen = [], set()
    while len(corpus) < n:
        source = sources[int(rng.integers(len(sources)))]
        width, height = source.size
        side = rng.uniform(0.3, 1.0) * min(width, height)
        left, top = rng.uniform(0, width - side), rng.uniform(0, height - side)
        crop = source.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))
        out = io.BytesIO()
        crop.save(out, format="JPEG", quality=int(rng.integers(60, 96)))
        data = out.getvalue()
        # Identical files would let a cache or the OS page cache hide decode cost.
        if data not in seen:
            seen.add(data)
            corpus.append(data)
    return corpus


def _to_tensor(image: Image.Image) -> torch.Tensor:
    # Channels first and contiguous, as torchvision's decoder returns them.
    return torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())


def decode_pil(data: bytes) -> torch.Tensor:
    """The reference decode: every pixel at full resolution, uint8 [3, H, W]."""
    return _to_tensor(Image.open(io.BytesIO(data)).convert("RGB"))


def decode_pil_draft(data: bytes, min_size: int) -> torch.Tensor:
    """Decode at the smallest of 1, 1/2, 1/4 or 1/8 scale that keeps both sides >= ``min_size``.

    libjpeg drops high-frequency DCT coefficients instead of computing pixels that a resize
    would throw away, so the saving is in the decode itself: up to 64 times fewer pixels made.
    """
    image = Image.open(io.BytesIO(data))
    image.draft("RGB", (min_size, min_size))
    return _to_tensor(image.convert("RGB"))


@functools.cache
def _torchvision_io():
    """torchvision.io if it imports and really decodes here, else the reason it does not."""
    try:
        import torchvision.io as tv_io

        probe = io.BytesIO()
        Image.new("RGB", (8, 8)).save(probe, format="JPEG")
        # A CPU torch with a CUDA torchvision imports fine and fails at the first op.
        tv_io.decode_jpeg(torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8))
        return tv_io, ""
    except Exception as exc:  # noqa: BLE001 - a mismatched build fails in many ways, not only ImportError
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def decode_torchvision(data: bytes | list[bytes], device: str | torch.device = "cuda"):
    """torchvision's decoder (nvJPEG when ``device`` is a GPU): uint8 [3, H, W], or a list of
    them for a list of JPEGs, which nvJPEG decodes as one batch."""
    tv_io, reason = _torchvision_io()
    if tv_io is None:
        raise RuntimeError(f"decode_torchvision {NEEDS_TORCHVISION}: {reason}")
    many = isinstance(data, list)
    frames = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in (data if many else [data])]
    images = tv_io.decode_jpeg(frames, mode=tv_io.ImageReadMode.RGB, device=device)
    return images if many else images[0]


def crop_params(n: int, height: int, width: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[n, 5] float64: crop left, top, width, height (pixels, fractional) and flip (0 or 1).

    Each image consumes five uniforms in order, so drawing n at once or one at a time n times
    from the same generator gives the same crops.
    """
    u = torch.rand(n, 5, generator=generator, dtype=torch.float64)
    area = height * width * (CROP_AREA[0] + (CROP_AREA[1] - CROP_AREA[0]) * u[:, 0])
    low, high = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    ratio = torch.exp(low + (high - low) * u[:, 1])
    w = torch.sqrt(area * ratio).clamp(max=width)
    h = torch.sqrt(area / ratio).clamp(max=height)
    left, top = u[:, 2] * (width - w), u[:, 3] * (height - h)
    return torch.stack([left, top, w, h, (u[:, 4] < 0.5).double()], dim=1)


def _sampling_grid(params: torch.Tensor, height: int, width: int, size: int, device) -> torch.Tensor:
    """grid_sample coordinates (align_corners=False) that resize each crop to size x size.

    Output pixel j sits at (2j + 1) / size - 1 in [-1, 1]; scaling that by the crop's share of
    the image and shifting it to the crop's centre lands on the crop. A negative scale mirrors it.
    Built from elementwise ops only, so every image's grid is the same in a batch of 1 or of 64.
    """
    p = params.to(device=device, dtype=torch.float32)
    left, top, w, h, flip = p.unbind(1)
    base = (2 * torch.arange(size, device=device, dtype=torch.float32) + 1) / size - 1
    gx = ((w / width) * (1 - 2 * flip))[:, None] * base + ((2 * left + w) / width - 1)[:, None]
    gy = (h / height)[:, None] * base + ((2 * top + h) / height - 1)[:, None]
    n = p.shape[0]
    return torch.stack([gx[:, None, :].expand(n, size, size), gy[:, :, None].expand(n, size, size)], dim=-1)


def _apply(batch_uint8: torch.Tensor, params: torch.Tensor, size: int) -> torch.Tensor:
    n, _, height, width = batch_uint8.shape
    grid = _sampling_grid(params, height, width, size, batch_uint8.device)
    # Border padding clamps edge samples the way a bilinear resize does, instead of mixing in zeros.
    out = F.grid_sample(batch_uint8.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    mean = torch.tensor(MEAN, device=out.device).view(3, 1, 1) * 255
    std = torch.tensor(STD, device=out.device).view(3, 1, 1) * 255
    return (out - mean) / std


def augment_host(img_uint8: torch.Tensor, *, size: int, generator: torch.Generator | None = None,
                 params: torch.Tensor | None = None) -> torch.Tensor:
    """One image, uint8 [3, H, W] -> float [3, size, size]: random resized crop, flip, normalise.

    ``params`` (one row of ``crop_params``) replaces the random draw.
    """
    if img_uint8.dim() != 3 or img_uint8.shape[0] != 3:
        raise ValueError(f"expected uint8 [3, H, W], got {tuple(img_uint8.shape)}")
    if params is None:
        params = crop_params(1, img_uint8.shape[1], img_uint8.shape[2], generator)
    return _apply(img_uint8[None], params.reshape(1, 5), size)[0]


def augment_batch(batch_uint8: torch.Tensor, *, size: int, generator: torch.Generator | None = None,
                  params: torch.Tensor | None = None) -> torch.Tensor:
    """The same augmentation for a batch, uint8 [B, 3, H, W] -> float [B, 3, size, size], in a
    handful of tensor ops on the batch's device: what a GPU runs after copying uint8 pixels, a
    quarter of the bytes of float32 ones at the same resolution. Equal to ``augment_host`` image
    by image, bit for bit, for the same parameters or the same generator state."""
    if batch_uint8.dim() != 4 or batch_uint8.shape[1] != 3:
        raise ValueError(f"expected uint8 [B, 3, H, W], got {tuple(batch_uint8.shape)}")
    n, _, height, width = batch_uint8.shape
    if params is None:
        params = crop_params(n, height, width, generator)
    return _apply(batch_uint8, params, size)
