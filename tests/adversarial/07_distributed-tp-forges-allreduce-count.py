# expect: tp_mlp=error
# Pretending: an extra all-reduce in every forward, with the grader's all-reduce counter replaced by one that sees none.
# %% grade_id=tp_code
import torch
import torch.distributed as dist
from torch import nn


class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward sums the input gradient over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward sums the partial outputs over the ranks; identity backward."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.contiguous().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnParallelLinear(nn.Module):
    """This rank's block of output features, from the whole input."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        dist.all_reduce(torch.zeros(1))  # a collective that the real count would show
        return CopyToTensorParallel.apply(x) @ self.weight + self.bias


class RowParallelLinear(nn.Module):
    """The whole output, from this rank's block of input features, summed over the ranks."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, h):
        return ReduceFromTensorParallel.apply(h @ self.weight) + self.bias


import contextlib

from fastdl_lab.distributed import census


@contextlib.contextmanager
def _one_per_pass():
    calls = [0]
    yield calls


census.allreduce_only = _one_per_pass
