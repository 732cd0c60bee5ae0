# expect: bytes_per_param=rejected
# Reading the answers: the calculator is the package's reference, bound at the cell's top level.
# %% grade_id=memory_code
from fastdl_lab.amp import bytes_per_param_ref

bytes_per_param = bytes_per_param_ref
