# expect: parameter_server=failed
# Pretending: a rule that ignores staleness, and the grader's server loop replaced by one that reports none.
# %% grade_id=ps_code
from fastdl_lab.distributed import ps


def bounded_staleness_rule(server_version, gradient_version, tau):
    return True


_honest = ps.run_ps


def _forged(*args, **kwargs):
    return _honest(*args, **kwargs)


ps.run_ps = _forged
