# A realistic mistake: f passes the gradient straight through in backward, like g, so each rank
# keeps only its own share of the input's gradient instead of the sum over the ranks.
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
        return CopyToTensorParallel.apply(x) @ self.weight + self.bias


class RowParallelLinear(nn.Module):
    """The whole output, from this rank's block of input features, summed over the ranks."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, h):
        return ReduceFromTensorParallel.apply(h @ self.weight) + self.bias
