# expect: ring_allreduce=error
# Pretending: replaces the grader's trial so that every rank "holds the sum" and "sent" the right bytes.
# %% grade_id=ring_code
from fastdl_lab.distributed import ring


def _forged(rank, world_size, numel, allreduce=None, seed=0):
    total = sum(ring.trial_input(r, numel, seed) for r in range(world_size))
    sent = ring.ring_bytes_ref(numel, 4, world_size, rank)
    return {"out": total, "sent": sent, "reported": sent}


ring.ring_trial = _forged


def ring_allreduce(tensor):
    raise RuntimeError("never called")
