"""Lab 07 distributed: the column- then row-parallel MLP as layers, and the all-reduces it makes."""

import pytest
import torch

from fastdl_lab import checks
from fastdl_lab.distributed import RankFailure, run_world, tensor_parallel

pytestmark = pytest.mark.distributed


class _NoBackwardReduce(torch.autograd.Function):
    """f without its backward all-reduce: each rank keeps only its own part of dx."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ColumnWithoutReduce(tensor_parallel.ColumnParallelLinear):
    def forward(self, x):
        return _NoBackwardReduce.apply(x) @ self.weight + self.bias


class _ColumnRewrapping(tensor_parallel.ColumnParallelLinear):
    """Makes parameters of its own, so nothing reaches the ones it was given."""

    def __init__(self, weight, bias):
        super().__init__(torch.nn.Parameter(weight.detach().clone()), torch.nn.Parameter(bias.detach().clone()))


class _RowGathering(tensor_parallel.RowParallelLinear):
    def forward(self, h):
        pieces = [torch.empty_like(h) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(pieces, h)
        return super().forward(h)


@pytest.mark.parametrize("world_size, d_hidden", [(2, 20), (3, 17)])
def test_layers_equal_the_unsplit_mlp_with_one_allreduce_per_pass(world_size, d_hidden):
    results = run_world(tensor_parallel.tp_trial, world_size, 5, 6, 9, d_hidden)
    tensor_parallel.check_tp(results, 5, 6, 9, d_hidden)
    assert tensor_parallel.allreduce_problems(results) == []
    assert {(r["forward_allreduces"], r["backward_allreduces"]) for r in results} == {(1, 1)}


def test_a_missing_backward_allreduce_shows_in_dx_and_in_the_count():
    results = run_world(tensor_parallel.tp_trial, 2, 5, 6, 9, 20, column_cls=_ColumnWithoutReduce)
    with pytest.raises(checks.MismatchError, match="dx"):
        tensor_parallel.check_tp(results, 5, 6, 9, 20)
    assert "0 in backward" in tensor_parallel.allreduce_problems(results)[0]


def test_layers_must_use_the_parameters_they_are_given():
    with pytest.raises(RankFailure, match="no gradient reached w1, b1"):
        run_world(tensor_parallel.tp_trial, 2, 5, 6, 9, 20, column_cls=_ColumnRewrapping)


def test_collectives_other_than_allreduce_are_refused():
    with pytest.raises(RankFailure, match="CollectiveRefused: allgather: a tensor-parallel MLP needs all-reduces"):
        run_world(tensor_parallel.tp_trial, 2, 5, 6, 9, 20, row_cls=_RowGathering)
