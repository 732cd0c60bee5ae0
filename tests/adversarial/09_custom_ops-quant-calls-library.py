# expect: per_channel_int8=rejected
# Library instead of the work: the scales by hand, the codes from torch's own per-channel quantizer.
# %% grade_id=quant_code
def quantize_per_channel(w):
    rows = w.detach().float().reshape(w.shape[0], -1)
    top = rows.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    codes = torch.quantize_per_channel(rows, scale.double(), zero, 0, torch.qint8).int_repr()
    return codes.clamp(-127, 127).reshape(w.shape), scale
