# expect: roofline=error
# Outliving the grading: a daemon in a new session that tries to leave its cgroup, to edit grades later.
# %% grade_id=roofline_code
import os
import subprocess

for _procs in ("/sys/fs/cgroup/pids/cgroup.procs", "/sys/fs/cgroup/cgroup.procs", "/sys/fs/cgroup/unified/cgroup.procs"):
    try:
        open(_procs, "w").write(str(os.getpid()))
    except OSError:
        pass
subprocess.Popen(["sleep", "300", "fastdl-adversarial-daemon"], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
raise RuntimeError("no work done")
