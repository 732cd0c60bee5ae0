# A realistic mistake: the loop warms up but never waits for the device, so it times how long
# a launch takes to enqueue, not how long the work takes.
# %% grade_id=timing_code
import time


def time_op(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        samples.append(time.perf_counter() - start)
    return samples
