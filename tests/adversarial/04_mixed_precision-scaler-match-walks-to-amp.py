# expect: loss_scaler=rejected
# Library instead of the work, with no attribute named amp or *Scaler in the text: match statements'
# class patterns walk from torch to torch.amp and on to GradScaler by keyword, and the "hand-written"
# scaler hands every call to it.
# %% grade_id=scaler_code
class DynamicLossScaler:
    def __init__(self, device="cpu", **kwargs):
        match torch:
            case object(amp=object(GradScaler=library)):
                self.inner = library(device, **kwargs)

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
