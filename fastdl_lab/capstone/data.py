"""The capstone's training data: the standard library's docstrings as one stream of bytes (lab 10).

Lab 06's corpus, read here as UTF-8 bytes: a vocabulary of 256 needs no tokenizer, and every
machine with Python has the text, so nothing is downloaded. The stream is the docstrings in the
order lab 06 lists them, each followed by a NUL byte (which no docstring contains) as an
end-of-text marker; the last tenth is held out for validation. A batch is ``batch_size`` windows of
``seq_len + 1`` bytes at random offsets: the first ``seq_len`` are the input, the last ``seq_len``
the targets, each byte predicting the next.
"""

from __future__ import annotations

import functools

import torch

from fastdl_lab.data import text

END_OF_TEXT = 0


@functools.cache
def _stream() -> torch.Tensor:
    data = b"".join(doc.encode("utf-8") + bytes([END_OF_TEXT]) for doc in text.docstring_texts())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def split(name: str) -> torch.Tensor:
    """``"train"`` (the first nine tenths of the stream) or ``"val"`` (the rest), as int64 byte values."""
    stream = _stream()
    cut = len(stream) * 9 // 10
    if name == "train":
        return stream[:cut]
    if name == "val":
        return stream[cut:]
    raise ValueError(f"split must be 'train' or 'val', got {name!r}")


def batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator,
          device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets, each ``(batch_size, seq_len)``: windows at offsets drawn from ``generator``."""
    if len(data) <= seq_len + 1:
        raise ValueError(f"{len(data)} bytes cannot hold a window of {seq_len + 1}")
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()])
    # Two tensors of their own, not two views of one: what a step saves is then counted per tensor.
    return windows[:, :-1].clone().to(device), windows[:, 1:].clone().to(device)


def batches(split_name: str, steps: int, batch_size: int, seq_len: int, seed: int = 0,
            device: str | torch.device = "cpu"):
    """``steps`` batches of one split, the same for the same seed (two runs see the same data)."""
    data, gen = split(split_name), torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield batch(data, batch_size, seq_len, gen, device)
