"""Sparse matrices on CPUs and GPUs: when skipping zeros pays (lab 09).

A weight matrix with most entries zero need not multiply them. Stored in **CSR** (compressed
sparse rows: the nonzeros, their column indices, and where each row starts), a sparse-times-dense
product does work in proportion to the nonzeros, but each one costs an index read and an
irregular gather of a row of the dense operand; a dense product does every multiply-add with
regular, vectorised, cache-blocked access. So sparse wins only at low density, and on a GPU,
whose tensor cores multiply dense tiles, unstructured sparsity rarely pays at all.

**2:4 structured sparsity** (NVIDIA's Ampere and later) makes the pattern regular: in every group
of four consecutive weights along a row at most two are nonzero. The tensor cores then store the
two values and a 2-bit index each, and multiply at up to twice the dense rate; PyTorch exposes
it as ``torch.sparse.to_sparse_semi_structured`` on a GPU. Pruning to 2:4 (keep the two largest
of every four, then fine-tune) usually costs little accuracy. Block sparsity (whole tiles zero) is
the other regular pattern kernels can skip.

- ``prune_2_4`` / ``is_2_4``: the pruning rule and its check;
- ``random_sparse``: a matrix with a given fraction of nonzeros;
- ``density_sweep``: ``torch.sparse.mm`` on CSR against the dense matmul, timed A/B per density;
- ``semi_structured``: the 2:4 GPU format (a GPU only).
"""

from __future__ import annotations

import warnings

import torch

from fastdl_lab import device


def prune_2_4(w: torch.Tensor) -> torch.Tensor:
    """``w`` with, in every group of four consecutive elements along the last dimension, the two of
    largest magnitude kept and the other two set to zero (ties: the earlier kept)."""
    if w.shape[-1] % 4:
        raise ValueError(f"the last dimension ({w.shape[-1]}) must be a multiple of 4 for 2:4 sparsity")
    groups = w.reshape(*w.shape[:-1], -1, 4)
    keep = groups.abs().topk(2, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(w.shape)


def is_2_4(w: torch.Tensor) -> bool:
    """Whether every group of four along the last dimension has at most two nonzeros."""
    if w.shape[-1] % 4:
        return False
    return bool(((w.reshape(*w.shape[:-1], -1, 4) != 0).sum(-1) <= 2).all())


def random_sparse(rows: int, cols: int, density: float, seed: int = 0) -> torch.Tensor:
    """A dense-stored ``rows x cols`` matrix whose entries are nonzero with probability ``density``."""
    if not 0 <= density <= 1:
        raise ValueError(f"density must be in [0, 1], got {density}")
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=gen)
    return values * (torch.rand(rows, cols, generator=gen) < density)


def density_sweep(n: int = 1024, densities=(0.001, 0.01, 0.05, 0.1, 0.3), reps: int = 10,
                  threads: int | None = 1) -> list[dict]:
    """For each density, an ``n x n`` sparse matrix (CSR) times an ``n x n`` dense one, against the
    same product dense, A/B-timed by the course's harness in ``threads`` threads. Rows: ``density``,
    ``nnz``, ``sparse_s``, ``dense_s``, ``speedup`` (dense time over sparse time)."""
    from fastdl_lab import checks, timing

    b = checks.randn(n, n, seed=1)
    rows = []
    for density in densities:
        a = random_sparse(n, n, density)
        with warnings.catch_warnings():  # PyTorch calls its CSR support beta, once per process
            warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
            a_csr = a.to_sparse_csr()
        checks.assert_close(torch.sparse.mm(a_csr, b), a @ b, atol=1e-3, rtol=1e-3, name=f"CSR at {density}")
        cmp = timing.compare(lambda: torch.sparse.mm(a_csr, b), lambda: a @ b, reps=reps, threads=threads)
        rows.append({"density": density, "nnz": int(a_csr.values().numel()), "sparse_s": cmp.candidate.median,
                     "dense_s": cmp.baseline.median, "speedup": cmp.speedup, "comparison": cmp})
    return rows


def semi_structured(w: torch.Tensor):
    """``w`` (2:4, fp16 or bf16, on a GPU) in the tensor cores' compressed 2:4 format."""
    if not device.has_gpu():
        raise RuntimeError("needs a GPU: 2:4 semi-structured sparsity is a tensor-core format (Ampere and later)")
    if not is_2_4(w):
        raise ValueError("w is not 2:4 sparse: prune_2_4 it first")
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(w)
