# expect: matmul_speed=error
# Pretending to be fast: the tuned launch configuration carries Triton's warmup option, which compiles the kernel and returns without running it, so the timed call would cost nothing.
# %% grade_id=matmul_tuning_code
MATMUL_CONFIG = {"block_m": 128, "block_n": 128, "block_k": 32, "num_warps": 4, "num_stages": 3, "warmup": True}
