"""Loss scaling by hand, to the contract of ``torch.amp.GradScaler``.

fp16 gradients below 2^-24 become zero. Multiplying the loss by a scale S multiplies every
gradient by S (backward is linear in its incoming gradient), which lifts them into range; the
optimizer must then see the gradients divided by S again, and a step whose scaled gradients
overflowed must not be taken at all. A dynamic scaler also picks S: it halves S after an overflow
and doubles it after ``growth_interval`` clean steps in a row, so S hovers just below the largest
value that does not overflow.

``scripted_run`` trains a small model through any scaler with overflows injected at chosen steps:
the lab and the tests run it with ``DynamicLossScaler`` and with ``torch.amp.GradScaler`` and
compare the two step for step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastdl_lab import checks
from fastdl_lab.amp.training import train_step_amp


def _fp32(x: float) -> float:
    """``x`` rounded to fp32. torch keeps its scale in an fp32 tensor, so a factor that is not a
    power of two rounds there; rounding here the same way keeps both scalers equal."""
    return float(torch.tensor(x, dtype=torch.float32))


class DynamicLossScaler:
    """A dynamic loss scaler with ``torch.amp.GradScaler``'s methods and semantics.

    An iteration is ``scale(loss).backward()``, optionally ``unscale_(optimizer)`` (to clip or
    inspect the true gradients), ``step(optimizer)`` and ``update()``; several optimizers may
    share one scaler within an iteration, as with torch.

    ``device`` (the gradients' device) holds the verdict of the inf/NaN check: one flag per
    optimizer, which the host reads once per step, as torch does, rather than once per gradient.
    The scale itself is kept on the host, as a Python float holding an fp32 value.

    ``skipped`` has one flag per iteration closed by ``update()``: True when some gradient of that
    iteration was inf or NaN, so that the optimizer step(s) were skipped.
    """

    def __init__(self, device: str | torch.device = "cpu", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval <= 0:
            raise ValueError(f"growth_interval must be a positive int, got {growth_interval!r}")
        self.device = torch.device(device)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._enabled = bool(enabled)
        self._scale = _fp32(init_scale)
        self._growth_tracker = 0
        # Per optimizer (by id) for the current iteration: the device flag its unscale_ found,
        # and whether its step was taken or skipped already.
        self._found_inf: dict[int, torch.Tensor] = {}
        self._stepped: set[int] = set()
        self.skipped: list[bool] = []

    def scale(self, outputs):
        """``outputs`` (a tensor, or nested lists / tuples of tensors) multiplied by the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            # A 0-dim fp32 tensor rather than a Python float, as torch's: type promotion then turns
            # a 0-dim fp16 loss into fp32, where a scale above 65504 does not make it inf.
            return outputs * torch.full((), self._scale, dtype=torch.float32, device=outputs.device)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise ValueError(f"outputs must be a tensor or lists / tuples of tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide every gradient the optimizer holds by the scale, in place, and note for this
        iteration whether any of them was inf or NaN. At most once per optimizer per iteration."""
        ### BEGIN SOLUTION
        if not self._enabled:
            return
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("unscale_() is being called after step(); call update() to end the iteration first")
        if key in self._found_inf:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update()")
        # The reciprocal is taken in fp64 and rounded once to fp32, as torch does: for a scale that
        # is not a power of two, multiplying by it is then bit for bit what torch computes.
        inv_scale = _fp32(1.0 / self._scale)
        found = torch.zeros((), dtype=torch.bool, device=self.device)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if param.grad.dtype == torch.float16:
                        # Unscaled in fp16, small gradients would underflow all over again.
                        raise ValueError("refusing to unscale fp16 gradients: keep fp32 master parameters")
                    # Checked before dividing: a huge scaled value is an overflow even if dividing
                    # would bring it back into range.
                    found |= ~torch.isfinite(param.grad).all().to(self.device)
                    param.grad.mul_(inv_scale)
        self._found_inf[key] = found
        ### END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``unscale_`` (unless done this iteration), then ``optimizer.step(*args, **kwargs)`` unless
        a gradient was inf or NaN. Returns what ``optimizer.step`` returned, or None when skipped."""
        ### BEGIN SOLUTION
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("a closure would recompute the loss unscaled; closures are not supported")
        key = id(optimizer)
        if key in self._stepped:
            raise RuntimeError("step() has already been called since the last update()")
        if key not in self._found_inf:
            self.unscale_(optimizer)
        self._stepped.add(key)
        # The one host-device synchronisation of the iteration.
        if bool(self._found_inf[key]):
            return None
        return optimizer.step(*args, **kwargs)
        ### END SOLUTION

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """End the iteration: back off after an overflow (resetting the count of clean steps), else
        count a clean step and grow after ``growth_interval`` of them; ``new_scale`` sets the scale
        instead. Growth that would overflow fp32 is not applied."""
        ### BEGIN SOLUTION
        if not self._enabled:
            return
        found = any(bool(flag) for flag in self._found_inf.values())
        if new_scale is not None:
            self._scale = _fp32(float(new_scale))
        elif not self._found_inf:
            raise RuntimeError("update() found no inf/NaN check this iteration: call step() (or unscale_()) first")
        elif found:
            self._scale = _fp32(self._scale * self.backoff_factor)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = _fp32(self._scale * self.growth_factor)
                if math.isfinite(grown):
                    self._scale = grown
                self._growth_tracker = 0
        if self._found_inf:
            self.skipped.append(found)
        self._found_inf.clear()
        self._stepped.clear()
        ### END SOLUTION

    def get_scale(self) -> float:
        """The current scale; 1.0 when disabled."""
        return self._scale if self._enabled else 1.0

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_tracker(self) -> int:
        """Clean steps in a row since the last growth or backoff."""
        return self._growth_tracker if self._enabled else 0

    def state_dict(self) -> dict:
        """The scaler's state under torch's keys, so either scaler can load the other's; {} when disabled."""
        if not self._enabled:
            return {}
        return {"scale": self._scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self._growth_tracker}

    def load_state_dict(self, state_dict: Mapping) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("the state dict is empty: it was saved from a disabled scaler")
        self._scale = _fp32(state_dict["scale"])
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


class StaticLossScaler(DynamicLossScaler):
    """One fixed scale. Steps whose gradients overflowed are still skipped (as Megatron's constant
    scaler does), but nothing adapts: too large a scale skips every step, too small a one leaves
    gradients in fp16's underflow. Built on ``DynamicLossScaler``: every update names the scale
    it already has."""

    def __init__(self, scale: float = 2.0**10, device: str | torch.device = "cpu", enabled: bool = True):
        super().__init__(device, init_scale=scale, enabled=enabled)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(self._scale if new_scale is None else new_scale)


def scripted_run(scaler, steps: int = 12, inject: Mapping[int, str] | None = None, *, max_norm: float | None = None,
                 dtype: torch.dtype = torch.float16, seed: int = 0) -> dict:
    """Train a small MLP on fixed data with SGD and momentum for ``steps`` steps of ``train_step_amp``
    (autocast to ``dtype``) through ``scaler``.

    ``inject`` maps a step to "inf" or "nan": on that step the first layer's weight gradient is
    multiplied by inf (or NaN) as backward produces it, as an overflowing fp16 gradient would
    arrive. ``max_norm`` has every step unscale and clip. Returns per step ``scale`` (after the
    update), ``skipped`` (the optimizer step did not run) and ``loss``; ``params``, the final
    parameters; and ``state``, the scaler's ``state_dict()``.
    """
    inject = dict(inject or {})
    unknown = {kind for kind in inject.values() if kind not in ("inf", "nan")}
    if unknown:
        raise ValueError(f"inject values must be 'inf' or 'nan', got {sorted(unknown)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = checks.randn(32, 8, seed=seed + 1)
    y = checks.randn(32, 4, seed=seed + 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    current = {"step": 0, "taken": False}
    poison = {"inf": math.inf, "nan": math.nan}
    model[0].weight.register_hook(lambda g: g * poison[inject[current["step"]]] if current["step"] in inject else g)
    # A step-post hook sees whether the optimizer really stepped, for any scaler.
    optimizer.register_step_post_hook(lambda *_: current.update(taken=True))
    out = {"scale": [], "skipped": [], "loss": []}
    for step in range(steps):
        current.update(step=step, taken=False)
        out["loss"].append(train_step_amp(model, optimizer, scaler, x, y, F.mse_loss, dtype=dtype, max_norm=max_norm))
        out["scale"].append(scaler.get_scale())
        out["skipped"].append(not current["taken"])
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["state"] = scaler.state_dict()
    return out
