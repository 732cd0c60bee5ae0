# expect: per_channel_int8=rejected
# Reading the answers: the quantiser imports the package's reference when it is called.
# %% grade_id=quant_code
def quantize_per_channel(w):
    from fastdl_lab.quant.formats import quantize_per_channel_ref
    return quantize_per_channel_ref(w)
