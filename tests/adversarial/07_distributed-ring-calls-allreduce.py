# expect: ring_allreduce=error
# Library instead of the work: the library's all-reduce, and the byte count the formula predicts.
# %% grade_id=ring_code
import torch.distributed as dist

from fastdl_lab.distributed import ring


def ring_allreduce(tensor):
    dist.all_reduce(tensor)
    return ring.ring_bytes_ref(tensor.numel(), tensor.element_size(), dist.get_world_size(), dist.get_rank())
