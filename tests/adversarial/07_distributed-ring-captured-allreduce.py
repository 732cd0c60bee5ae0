# expect: ring_allreduce=error
# Library instead of the work: all_reduce captured when the cell runs, before the grader can refuse it.
# %% grade_id=ring_code
import torch.distributed as dist
from torch.distributed import all_reduce as _captured

from fastdl_lab.distributed import ring


def ring_allreduce(tensor):
    _captured(tensor)
    return ring.ring_bytes_ref(tensor.numel(), tensor.element_size(), dist.get_world_size(), dist.get_rank())
