# expect: loss_scaler=rejected
# Calling the library, with no name of it in the code: the unpickler looks the scaler class up from bytes.
# %% grade_id=scaler_code
import torch


class DynamicLossScaler:
    def __init__(self, device="cpu", **kwargs):
        found = torch.serialization.pickle.loads(b"ctorch.a" + b"mp\nGradSc" + b"aler\n.")
        self.inner = found(device, **kwargs)

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
