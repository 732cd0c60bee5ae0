# expect: timing=failed
# Bloating the batch: a 4 GiB (sparse) outputs file.
# %% grade_id=timing_code
import os

with open("/job/outputs.pt", "wb") as _f:
    _f.truncate(4 << 30)
os._exit(0)
