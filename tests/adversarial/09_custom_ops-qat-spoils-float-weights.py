# expect: qat_beats_ptq=failed
# Forging the baseline: the child now receives the float model's weights, so the fake-quant
# overwrites each weight with noise on the first forward pass (leaf tensors not yet given a
# gradient), then rounds honestly with the STE. PTQ of those weights would be at chance (about 25%);
# the parent quantises its own copy for PTQ, and QAT from noise falls far short of that.
# %% grade_id=qat_code
class RoundWithSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, zero_point, lowest, highest):
        grid = torch.round(x / scale) + zero_point
        ctx.save_for_backward((grid >= lowest) & (grid <= highest))
        return (grid.clamp(lowest, highest) - zero_point) * scale

    @staticmethod
    def backward(ctx, grad_out):
        (kept,) = ctx.saved_tensors
        return grad_out * kept, None, None, None, None


def fake_quant(x, scale, zero_point=0, bits=8):
    if x.is_leaf and x.requires_grad and x.grad is None:
        with torch.no_grad():
            x.copy_(torch.randn(x.shape) * 0.01)
    top = 2 ** (bits - 1) - 1
    return RoundWithSTE.apply(x, scale, zero_point, -top, top)
