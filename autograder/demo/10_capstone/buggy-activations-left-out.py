# A realistic mistake: the step's memory as lab 04 counted it, 16 bytes per parameter for fp32
# weights, gradients and AdamW's two moments, and nothing for the activations the forward saves.
# The first three parts are right; the prediction misses the part that grows with the batch.
# %% grade_id=memory_code
def predict_memory(config, batch_size, attention="torch", recompute_blocks=0):
    V, T, d, L = config.vocab_size, config.seq_len, config.d_model, config.n_layer
    params = (V + T) * d + L * ((4 + 2 * config.mlp_ratio) * d * d + (9 + config.mlp_ratio) * d) + 2 * d
    return {"weights": 4 * params, "grads": 4 * params, "optimizer": 8 * params, "activations": 0}
