# expect: capstone_block=error capstone_training=error
# Reading the answers: the block is the package's own, imported at the cell's top and subclassed.
# %% grade_id=block_code
from fastdl_lab.capstone.model import Block as ReferenceBlock


class Block(ReferenceBlock):
    pass
