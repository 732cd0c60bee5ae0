# expect: timing=failed
# Samples that add up: warmed up, then every timed launch queued at once and one synchronize at
# the end; each sample is the total divided by the count, which matches the device's time per op
# although no single launch was waited for.
# %% grade_id=timing_code
import time


def time_op(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    dev.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dev.launch()
    dev.synchronize()
    return [(time.perf_counter() - start) / iters] * iters
