# expect: timing=failed
# Faking the synchronize: every launch is followed by a sleep of the op's own length, so each
# sample is the right size although nothing ever waits for the device.
# %% grade_id=timing_code
import time


def time_op(dev, iters=10, warmup=2):
    for _ in range(warmup):
        dev.launch()
    time.sleep(dev.compile_seconds + warmup * dev.op_seconds)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        dev.launch()
        time.sleep(dev.op_seconds)
        samples.append(time.perf_counter() - start)
    return samples
