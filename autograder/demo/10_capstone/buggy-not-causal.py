# A realistic mistake: the block writes its attention out by hand instead of calling the function
# it was given, and forgets the causal mask. Every position then attends to later tokens: the
# output differs from the reference, and a model of these blocks learns to read the answer.
# %% grade_id=block_code
class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config, layernorm, attention):
        super().__init__()
        d = config.d_model
        self.n_head = config.n_head
        self.attention = attention
        self.ln1 = LayerNorm(d, layernorm, config.eps)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d)})
        self.ln2 = LayerNorm(d, layernorm, config.eps)
        self.mlp = nn.ModuleDict({"fc": nn.Linear(d, config.mlp_ratio * d), "proj": nn.Linear(config.mlp_ratio * d, d)})

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.attn["qkv"](self.ln1(x)).view(b, t, 3, self.n_head, d // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_head)
        o = scores.softmax(dim=-1) @ v
        x = x + self.attn["proj"](o.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp["proj"](F.gelu(self.mlp["fc"](self.ln2(x)), approximate="tanh"))
