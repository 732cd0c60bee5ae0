# A realistic mistake: the gradients are summed over the ranks but never divided by the world
# size, so every step is world_size times too large.
# %% grade_id=ddp_code
import torch.distributed as dist


def allreduce_gradients(model, world_size):
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
