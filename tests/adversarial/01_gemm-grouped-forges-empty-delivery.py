# expect: grouped_order=failed
# Forging the delivery with a degenerate answer: the cell reads how many grids the grader sent and
# delivers, for each, an empty list of programs (nothing to compare is nothing wrong), then ends
# the process before the grader's runner calls grouped_pid.
# %% grade_id=grouped_order_code
import os

from autograder import wire
from autograder.engine import channel

_grids = wire.load("/job/in/inputs.wire", cap=1 << 30)["cases"]
channel.child_link.send("outputs", value=[[] for _ in _grids])
os._exit(0)
