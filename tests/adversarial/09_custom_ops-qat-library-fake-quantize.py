# expect: qat_beats_ptq=rejected
# Library instead of the work: torch's fake-quantize op, whose backward is already the
# straight-through estimator, in place of a hand-written one.
# %% grade_id=qat_code
def fake_quant(x, scale, zero_point=0, bits=8):
    top = 2 ** (bits - 1) - 1
    zero = torch.zeros((), dtype=torch.int32)
    return torch.fake_quantize_per_tensor_affine(x, scale.float(), zero, -top, top)
