"""Lab 10, the capstone: a small GPT trained on the course's own kernels, measured end to end.

- ``model``: the transformer, its LayerNorm and attention swappable (torch's, the course's in plain
  PyTorch, the course's Triton kernels, or a student's own), with its parameter and FLOP counts;
- ``data``: the standard library's docstrings as a stream of bytes, batches of windows;
- ``step``: AdamW (torch's or the course's), training, a step's time, tokens/s and MFU, and the
  step's memory split into weights, gradients, optimizer state and activations;
- ``experiments``: activation checkpointing per block, bf16 autocast against fp32, torch.compile
  with its graph breaks, each with a plot.
"""

from fastdl_lab import device  # noqa: F401  before Triton: the interpreter on where there is no GPU
