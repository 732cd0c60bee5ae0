# expect: ssp=tampered|rejected
# Forging the server's record: right answers, then, from inside the rule, the grader's server loop swapped (reached through torch's own reference to sys) for one that reports every worker in step.
# %% grade_id=ssp_code
def ssp_may_start(clocks, worker, tau):
    server_module = torch.sys.modules["fastdl_lab.distributed.ps"]
    honest = server_module.__dict__["_server"]
    if honest.__name__ == "_server":
        def forged(*args, **kwargs):
            out = honest(*args, **kwargs)
            out["clock_gaps"] = [0] * len(out["clock_gaps"])
            return out

        forged.__name__ = "forged"
        server_module.__dict__["_server"] = forged
    return clocks[worker] - min(clocks) <= tau
