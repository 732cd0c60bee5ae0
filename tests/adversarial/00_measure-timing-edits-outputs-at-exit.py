# expect: timing=tampered
# Rewriting the evidence after the grader's runner sent it: a time_op that times nothing, and an
# exit hook that delivers a second set of samples, the op time the device reports, over the
# runner's own line to the grader.
# %% grade_id=timing_code
import atexit


def time_op(dev, iters=10, warmup=2):
    atexit.register(_deliver_again, [dev.op_seconds * 1.01] * iters)
    return [0.0] * iters


def _deliver_again(samples):
    from autograder.engine import channel

    channel.child_link.send("outputs", value=samples)
