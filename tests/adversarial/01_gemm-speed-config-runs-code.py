# expect: matmul_speed=error
# Running Python in the trusted kernel child: the tuned configuration is built by an expression
# that also starts a thread and rebinds the timer, hoping the grader evaluates it beside the kernel.
# %% grade_id=matmul_tuning_code
import threading
import time

MATMUL_CONFIG = dict(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=2,
                     **{} if threading.Thread(target=time.sleep, args=(60,), daemon=True).start() else {})
time.perf_counter = lambda: 0.0
