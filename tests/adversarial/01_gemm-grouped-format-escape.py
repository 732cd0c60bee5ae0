# expect: grouped_order=error|failed
# Syntax that reads attributes without naming them: str.format's field lookup (through
# string.Formatter) walks from a function's globals to the real import, and hands the question to
# the package's own grouped_pid_ref.
# %% grade_id=grouped_order_code
import string

_lookup = string.Formatter().get_field


def grouped_pid(pid, num_pid_m, num_pid_n, group_m):
    importer, _ = _lookup("0.__globals__[__builtins__][__import__]", (grouped_pid,), {})
    gemm = importer("fastdl_lab.gemm", fromlist=["grouped_pid_ref"])
    reference, _ = _lookup("0.grouped_pid_ref", (gemm,), {})
    return reference(pid, num_pid_m, num_pid_n, group_m)
