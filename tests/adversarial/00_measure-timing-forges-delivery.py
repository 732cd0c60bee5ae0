# expect: timing=failed
# Forging the delivery: time_op launches nothing, sends the grader samples of exactly the op time
# the device reports, on the runner's own line, and ends the process before the runner can say
# anything else.
# %% grade_id=timing_code
import os


def time_op(dev, iters=10, warmup=2):
    from autograder.engine import channel

    channel.child_link.send("outputs", value=[dev.op_seconds * 1.001] * iters)
    os._exit(0)
