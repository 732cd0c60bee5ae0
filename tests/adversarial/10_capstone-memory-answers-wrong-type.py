# expect: capstone_memory=failed
# Numbers no comparison can hold: NaN is neither above nor below a tolerance, infinity and a
# negative count are numbers all the same. A check that asks "is the error above the tolerance?"
# would pass NaN.
# %% grade_id=memory_code
def predict_memory(config, batch_size, attention="torch", recompute_blocks=0):
    return {"weights": float("nan"), "grads": float("nan"), "optimizer": float("nan"), "activations": float("nan")}
