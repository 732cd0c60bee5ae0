# expect: per_channel_int8=rejected
# Library instead of the work, with no attribute in the text: a match statement's class patterns
# read torch's quantizer and the qint8 dtype off the torch module by keyword.
# %% grade_id=quant_code
def quantize_per_channel(w):
    rows = w.detach().float().reshape(w.shape[0], -1)
    top = rows.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    match torch:
        case object(quantize_per_channel=quantize, qint8=qint8):
            zero = torch.zeros(w.shape[0], dtype=torch.long)
            match quantize(rows, scale.double(), zero, 0, qint8):
                case object(int_repr=codes):
                    return codes().clamp(-127, 127).reshape(w.shape), scale
