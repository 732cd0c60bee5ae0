# expect: ring_allreduce=error
# Library instead of the work: the process group's own all-reduce, below torch.distributed's functions.
# %% grade_id=ring_code
import torch.distributed as dist

from fastdl_lab.distributed import ring


def ring_allreduce(tensor):
    dist.group.WORLD.allreduce([tensor]).wait()
    return ring.ring_bytes_ref(tensor.numel(), tensor.element_size(), dist.get_world_size(), dist.get_rank())
