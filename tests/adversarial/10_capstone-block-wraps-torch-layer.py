# expect: capstone_block=rejected capstone_training=rejected
# The library's block behind a name the screen might not model: torch's own pre-norm encoder
# layer, found by a string, with a causal mask.
# %% grade_id=block_code
class Block(nn.Module):
    def __init__(self, config, layernorm, attention):
        super().__init__()
        layer = getattr(nn, "Transformer" + "EncoderLayer")
        self.inner = layer(config.d_model, config.n_head, 4 * config.d_model, 0.0, norm_first=True, batch_first=True)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        return self.inner(x, src_mask=mask)
