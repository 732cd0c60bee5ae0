# A realistic mistake: an overflow backs the scale off but leaves the count of clean steps where it
# was, so the scale can grow again on the very next clean step, straight back into the overflow.
# %% grade_id=scaler_code
class DynamicLossScaler:
    """Dynamic loss scaling by hand, with torch.amp.GradScaler's contract."""

    def __init__(self, device="cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be above 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if int(growth_interval) != growth_interval or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer, got {growth_interval}")
        self.device = device
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._scale = float(init_scale)
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf = False

    def get_scale(self):
        return self._scale

    def scale(self, outputs):
        if isinstance(outputs, torch.Tensor):
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs must be a tensor or a list/tuple of tensors, not {type(outputs).__name__}")

    def unscale_(self, optimizer):
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called since the last update()")
        # Powers of two (and the default factors) make 1/scale exact in fp32, as GradScaler's is.
        inverse = 1.0 / self._scale
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.grad.mul_(inverse)
                found = found or not bool(torch.isfinite(p.grad).all())
        self._found_inf, self._unscaled = found, True

    def step(self, optimizer, *args, **kwargs):
        if not self._unscaled:
            self.unscale_(optimizer)
        if self._found_inf:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self):
        if self._found_inf:
            self._scale *= self.backoff_factor
            clean_steps = self._growth_tracker
        else:
            clean_steps = self._growth_tracker + 1
            if clean_steps == self.growth_interval:
                grown = self._scale * self.growth_factor
                # GradScaler keeps its scale in fp32 and refuses to grow it to inf.
                if grown <= torch.finfo(torch.float32).max:
                    self._scale = grown
                clean_steps = 0
        self._growth_tracker = clean_steps
        self._unscaled = self._found_inf = False
