# expect: loss_scaler=rejected
# Calling the library, disguised: the scaler class is looked up by a string built at run time.
# %% grade_id=scaler_code
import torch

LIBRARY = "".join(["Grad", "Scaler"])


class DynamicLossScaler:
    def __init__(self, device="cpu", **kwargs):
        module = getattr(torch, "a" + "mp")
        self.inner = getattr(module, LIBRARY)(device, **kwargs)

    def get_scale(self):
        return self.inner.get_scale()

    def scale(self, outputs):
        return self.inner.scale(outputs)

    def unscale_(self, optimizer):
        return self.inner.unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        return self.inner.step(optimizer, *args, **kwargs)

    def update(self):
        return self.inner.update()
