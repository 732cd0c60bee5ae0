# expect: capstone_memory=rejected
# Reading the answers: the formula is the package's, imported at call time.
# %% grade_id=memory_code
def predict_memory(config, batch_size, attention="torch", recompute_blocks=0):
    from fastdl_lab.capstone.accounting import predict_memory_ref

    return predict_memory_ref(config, batch_size, attention, recompute_blocks)
