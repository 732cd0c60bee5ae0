# expect: capstone_block=rejected capstone_training=rejected
# Reading the answers without an import: every nn.Module subclass the process has loaded is one
# attribute away, the package's block among them.
# %% grade_id=block_code
class Block(nn.Module):
    def __init__(self, config, layernorm, attention):
        super().__init__()
        found = [c for c in nn.Module.__subclasses__() if c.__name__ == "Block" and c is not type(self)]
        self.inner = found[0](config, layernorm, attention)

    def forward(self, x):
        return self.inner(x)
