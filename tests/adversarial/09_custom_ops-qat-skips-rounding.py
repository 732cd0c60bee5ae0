# expect: qat_beats_ptq=failed
# Pretending to train with the rounding: fake_quant returns its input unchanged, so "QAT" is float
# fine-tuning, which is easy and smooth; the grader evaluates with the course's own rounding.
# %% grade_id=qat_code
def fake_quant(x, scale, zero_point=0, bits=8):
    return x * 1.0
