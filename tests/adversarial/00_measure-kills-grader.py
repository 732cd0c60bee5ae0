# expect: roofline=error|crashed
# Stopping the batch: kills every process above it, hoping the grader is among them.
# %% grade_id=roofline_code
import os
import signal

_pid = os.getppid()
while _pid > 1:
    with open(f"/proc/{_pid}/stat") as _f:
        _parent = int(_f.read().rsplit(")", 1)[1].split()[1])
    try:
        os.kill(_pid, signal.SIGKILL)
    except OSError:
        pass
    _pid = _parent
raise RuntimeError("nothing done")
