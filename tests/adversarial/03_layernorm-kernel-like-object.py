# expect: layernorm_fwd_fp32=not_a_kernel layernorm_bwd=not_a_kernel layernorm_stability=not_a_kernel layernorm_training=not_a_kernel layernorm_speed=not_a_kernel
# Library instead of a kernel: an object that looks launchable (kernel[grid](...), .fn) and calls F.layer_norm.
# %% grade_id=layernorm_fwd_code
import torch.nn.functional as F


class _Launchable:
    fn = None

    def __getitem__(self, grid):
        def launch(x, y, w, b, mean, rstd, *rest, **kw):
            y.copy_(F.layer_norm(x, x.shape[-1:], w, b))
        return launch


layernorm_fwd_kernel = _Launchable()
