"""Tensor parallelism: a transformer MLP split across ranks, Megatron-style (lab 07).

Data parallelism copies the model; when one layer no longer fits a device, or is too slow on
one, its matrices are split instead. For the MLP ``y = gelu(x W1 + b1) W2 + b2`` (Shoeybi et
al., 2019):

* **column-parallel W1**: rank r holds a block of W1's columns (and of b1), so it computes its own
  slice of the hidden units from the full input, with no communication; gelu acts element by
  element, so it applies to each slice separately;
* **row-parallel W2**: rank r holds the matching block of W2's rows, so ``h_r W2_r`` is rank r's
  partial sum of the output; one **all-reduce** adds the partial sums, then b2 is added once.

One all-reduce of the activations (tokens x d_model) per MLP forward, one more for the input
gradient in backward: the autograd functions ``_CopyToTensorParallel`` (identity forward,
all-reduce backward) and ``_ReduceFromTensorParallel`` (all-reduce forward, identity backward)
are the two conjugate operations Megatron calls f and g; ``ColumnParallelLinear`` starts with f,
``RowParallelLinear`` ends with g. ``tp_trial`` runs any pair of such classes on a rank and
counts the all-reduces each pass makes (``census.allreduce_only``). Because it communicates inside every
layer, tensor parallelism stays within a node's fast links (NVLink); pipeline parallelism
(``pipeline_bubble_fraction``) and data parallelism span nodes.

``sequence_parallel_mlp`` adds Megatron's sequence parallelism (Korthikanti et al., 2022): each
rank keeps 1/N of the tokens between blocks, and the all-reduce becomes an all-gather of tokens
before the block and a reduce-scatter after it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastdl_lab import checks
from fastdl_lab.distributed import census
from fastdl_lab.distributed.launch import rank_device, run_world
from fastdl_lab.distributed.ring import busbw_factor

WEIGHTS = ("w1", "b1", "w2", "b2")


def make_mlp(seed: int, d_model: int, d_hidden: int) -> dict[str, torch.Tensor]:
    """Weights of the MLP: w1 (d_model, d_hidden), b1 (d_hidden), w2 (d_hidden, d_model), b2 (d_model)."""
    return {"w1": checks.randn(d_model, d_hidden, seed=seed, scale=d_model ** -0.5),
            "b1": checks.randn(d_hidden, seed=seed + 1, scale=0.1),
            "w2": checks.randn(d_hidden, d_model, seed=seed + 2, scale=d_hidden ** -0.5),
            "b2": checks.randn(d_model, seed=seed + 3, scale=0.1)}


def mlp_ref(x: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """The unsplit MLP."""
    return F.gelu(x @ w1 + b1) @ w2 + b2


def shard_mlp(weights: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s pieces: a block of W1's columns and b1, the same block of W2's rows, all of b2.

    Blocks follow ``torch.tensor_split``, so d_hidden need not divide evenly.
    """
    return {"w1": torch.tensor_split(weights["w1"], world_size, dim=1)[rank].contiguous(),
            "b1": torch.tensor_split(weights["b1"], world_size)[rank].contiguous(),
            "w2": torch.tensor_split(weights["w2"], world_size, dim=0)[rank].contiguous(),
            "b2": weights["b2"].clone()}


class _CopyToTensorParallel(torch.autograd.Function):
    """f: every rank uses the whole input; its gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION
        return x.view_as(x)
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad
        ### END SOLUTION


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: the output is the sum of the ranks' partial outputs; each partial gets the whole gradient."""

    @staticmethod
    def forward(ctx, partial):
        ### BEGIN SOLUTION
        total = partial.contiguous().clone()
        dist.all_reduce(total)
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad
        ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """``x @ W[:, cols] + b[cols]`` for this rank's block of columns: the full input in, this
    rank's slice of the features out. ``weight`` (d_in, d_out / N) and ``bias`` are this rank's
    shards, used as given (their gradients are read from them)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        return _CopyToTensorParallel.apply(x) @ self.weight + self.bias
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """``h @ W + b`` where this rank holds a block of W's rows and the matching slice of h: the
    partial products are summed over the ranks, then the (whole) bias is added once."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        return _ReduceFromTensorParallel.apply(h @ self.weight) + self.bias
        ### END SOLUTION


class _GatherTokens(torch.autograd.Function):
    """Sequence slices in, the whole sequence out (all-gather); backward hands each rank the sum
    of every rank's gradient for its own slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x_local):
        world = dist.get_world_size()
        pieces = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(pieces, x_local.contiguous())
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size()
        mine = torch.empty_like(grad.chunk(world)[0])
        dist.reduce_scatter(mine, [g.contiguous() for g in grad.chunk(world)])
        return mine


class _ScatterTokens(torch.autograd.Function):
    """Partial sums of the whole sequence in, this rank's slice of their total out
    (reduce-scatter); backward gathers the slices' gradients back (all-gather)."""

    @staticmethod
    def forward(ctx, partial):
        world = dist.get_world_size()
        mine = torch.empty_like(partial.chunk(world)[0])
        dist.reduce_scatter(mine, [p.contiguous() for p in partial.chunk(world)])
        return mine

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size()
        pieces = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(pieces, grad.contiguous())
        return torch.cat(pieces)


def sequence_parallel_mlp(x_local: torch.Tensor, shard: dict[str, torch.Tensor]) -> torch.Tensor:
    """The MLP with Megatron's sequence parallelism: this rank holds 1/N of the tokens.

    The all-reduce of the column- then row-parallel MLP splits into its two halves: an all-gather of the
    token slices before the column-parallel matmul, a reduce-scatter of the partial outputs after
    the row-parallel one. Same bytes; but what lies between blocks (here the input and output,
    in a transformer also LayerNorm and dropout) is stored for 1/N of the tokens only. The
    number of tokens must divide by the world size.
    """
    hidden = F.gelu(_GatherTokens.apply(x_local) @ shard["w1"] + shard["b1"])
    return _ScatterTokens.apply(hidden @ shard["w2"]) + shard["b2"]


def _inputs(seed: int, tokens: int, d_model: int):
    return checks.randn(tokens, d_model, seed=seed + 10), checks.randn(tokens, d_model, seed=seed + 11)


def tp_trial(rank: int, world_size: int, seed: int, tokens: int, d_model: int, d_hidden: int,
             sequence_parallel: bool = False, column_cls=ColumnParallelLinear, row_cls=RowParallelLinear) -> dict:
    """One rank's forward and backward of the split MLP: output, input gradient, shard gradients,
    and the all-reduces made in each pass (``forward_allreduces``, ``backward_allreduces``).

    The MLP is ``row_cls(w2, b2)(gelu(column_cls(w1, b1)(x)))`` on this rank's shards, where
    only all-reduces may move data. With ``sequence_parallel`` it is ``sequence_parallel_mlp``
    instead, and the rank's input, output and their gradients are its slice of the tokens
    (``torch.chunk`` along dim 0); nothing is counted then.
    """
    dev = rank_device()
    shard = {k: nn.Parameter(v.to(dev)) for k, v in shard_mlp(make_mlp(seed, d_model, d_hidden),
                                                               rank, world_size).items()}
    x, dy = (t.to(dev) for t in _inputs(seed, tokens, d_model))
    if sequence_parallel:
        x, dy = x.chunk(world_size)[rank].contiguous(), dy.chunk(world_size)[rank].contiguous()
    x.requires_grad_()
    wanted = [x, *(shard[k] for k in WEIGHTS)]
    if sequence_parallel:
        y = sequence_parallel_mlp(x, shard)
        grads, counts = torch.autograd.grad(y, wanted, dy), {}
    else:
        column, row = column_cls(shard["w1"], shard["b1"]), row_cls(shard["w2"], shard["b2"])
        with census.allreduce_only() as calls:
            y = row(F.gelu(column(x)))
            forward_calls = calls[0]
            grads = torch.autograd.grad(y, wanted, dy, allow_unused=True)
        counts = {"forward_allreduces": forward_calls, "backward_allreduces": calls[0] - forward_calls}
        missing = [name for name, g in zip(("x", *WEIGHTS), grads) if g is None]
        if missing:
            raise ValueError(f"no gradient reached {', '.join(missing)}: the layers must compute with the "
                             "parameters they are given")
    return {"y": y, "dx": grads[0], **{f"d{k}": g for k, g in zip(WEIGHTS, grads[1:])}, **counts}


def allreduce_problems(results: list[dict]) -> list[str]:
    """Ranks that did not make exactly one all-reduce in forward and one in backward."""
    return [f"rank {rank}: {r['forward_allreduces']} all-reduce(s) in forward and {r['backward_allreduces']} in "
            "backward; the column- then row-parallel MLP needs exactly one in each"
            for rank, r in enumerate(results) if (r["forward_allreduces"], r["backward_allreduces"]) != (1, 1)]


def check_tp(results: list[dict], seed: int, tokens: int, d_model: int, d_hidden: int,
             sequence_parallel: bool = False) -> None:
    """Every rank's output and input gradient equal the unsplit MLP's (their token slices, with
    ``sequence_parallel``); shard gradients equal the matching blocks of the full gradients."""
    world_size = len(results)
    weights = {k: v.requires_grad_() for k, v in make_mlp(seed, d_model, d_hidden).items()}
    x, dy = _inputs(seed, tokens, d_model)
    x.requires_grad_()
    y = mlp_ref(x, *(weights[k] for k in WEIGHTS))
    grads = dict(zip(("dx", *(f"d{k}" for k in WEIGHTS)), torch.autograd.grad(y, [x, *weights.values()], dy)))
    expected_shards = [shard_mlp({k: grads[f"d{k}"] for k in WEIGHTS}, r, world_size) for r in range(world_size)]
    for rank, result in enumerate(results):
        rows = slice(None)
        if sequence_parallel:
            per_rank = tokens // world_size
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
        checks.assert_close(result["y"], y.detach()[rows], name=f"rank {rank} y")
        checks.assert_close(result["dx"], grads["dx"][rows], name=f"rank {rank} dx")
        for k in WEIGHTS[:3] if sequence_parallel else WEIGHTS:
            checks.assert_close(result[f"d{k}"], expected_shards[rank][k], name=f"rank {rank} d{k}")
    if sequence_parallel:
        # b2 acts on each rank's own tokens, so each holds a partial sum of its gradient; Megatron
        # all-reduces such gradients (LayerNorm's too) over the tensor-parallel group.
        checks.assert_close(sum(r["db2"] for r in results), grads["db2"], name="db2 summed over the ranks")


def allreduce_bytes_per_layer(tokens: int, d_model: int, element_size: int, world_size: int) -> float:
    """Bytes each rank sends for the one forward all-reduce of an MLP's output (ring algorithm)."""
    return busbw_factor(world_size) * tokens * d_model * element_size


def pipeline_bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a GPipe / 1F1B schedule: (p - 1) / (m + p - 1) with p stages and m micro-batches.

    Filling and draining the pipeline each take p - 1 slots in which some stage has no work.
    """
    return (stages - 1) / (microbatches + stages - 1)


def check() -> None:
    """The MLP split over 2 and 3 ranks (an uneven hidden size) equals the unsplit one, both passes."""
    for world_size, d_hidden in ((2, 32), (3, 29)):
        results = run_world(tp_trial, world_size, 0, 5, 12, d_hidden)
        check_tp(results, 0, 5, 12, d_hidden)
        assert not allreduce_problems(results), allreduce_problems(results)
        check_tp(run_world(tp_trial, world_size, 0, 6, 12, d_hidden, sequence_parallel=True), 0, 6, 12, d_hidden,
                 sequence_parallel=True)
    print("tensor_parallel: column- then row-parallel MLP (one all-reduce per pass), with and without sequence "
          "parallelism, equals the unsplit MLP, forward and backward")


if __name__ == "__main__":
    check()
