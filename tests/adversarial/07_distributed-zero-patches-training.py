# expect: zero1=tampered
# Pretending: ordinary Adam on every rank, with the grader's ZeRO training loop replaced to report a 1/N share.
# %% grade_id=zero_code
import torch

from fastdl_lab.distributed import zero

Zero1Adam = torch.optim.Adam
_honest = zero.train_zero


def _forged(*args, **kwargs):
    return _honest(*args, **kwargs)


zero.train_zero = _forged
