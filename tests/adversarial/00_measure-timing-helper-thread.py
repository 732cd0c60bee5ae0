# expect: timing=failed
# Doing the work outside the measured call: time_op returns invented samples at once and leaves
# the honest loop to a helper thread, which runs it on the same device afterwards.
# %% grade_id=timing_code
import threading
import time


def _honest_loop(dev, iters, warmup):
    try:
        for _ in range(warmup):
            dev.launch()
        dev.synchronize()
        for _ in range(iters):
            dev.launch()
            dev.synchronize()
    except RuntimeError:
        pass


def time_op(dev, iters=10, warmup=2):
    threading.Thread(target=_honest_loop, args=(dev, iters, warmup)).start()
    return [dev.op_seconds * 1.02] * iters
