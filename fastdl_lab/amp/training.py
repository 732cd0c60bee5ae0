"""Training steps in fp32 and with autocast, and a model that fp16 cannot train without loss scaling.

Under ``torch.autocast`` the parameters stay fp32 (they are the master weights); each op casts its
inputs to the low-precision dtype where that is safe (matmuls, convolutions) and keeps fp32 where
it is not (reductions, losses, softmax). Backward runs the same ops in the same dtypes, so the
gradients that flow between layers are fp16 or bf16, and only the parameters' own gradients are
cast back to fp32 at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastdl_lab import checks


def train_step_fp32(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                    loss_fn: Callable) -> float:
    """One plain training step: the reference every mixed-precision step is compared with."""
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def train_step_amp(model: nn.Module, optimizer: torch.optim.Optimizer, scaler, x: torch.Tensor, y: torch.Tensor,
                   loss_fn: Callable, *, dtype: torch.dtype = torch.bfloat16, max_norm: float | None = None) -> float:
    """One mixed-precision step: forward and loss under autocast to ``dtype`` on x's device type,
    backward of the scaled loss, gradients unscaled and clipped to ``max_norm`` (if given), then
    the scaler's step and update. Returns the unscaled loss as a float.

    ``scaler`` is a ``torch.amp.GradScaler`` built with a device, or a ``DynamicLossScaler``; bf16
    needs no scaling, so pass one built with ``enabled=False`` there.
    """
    ### BEGIN SOLUTION
    with torch.autocast(x.device.type, dtype=dtype):
        loss = loss_fn(model(x), y)
    # Backward outside the context: autograd replays each op in the dtype its forward used.
    scaler.scale(loss).backward()
    if max_norm is not None:
        # Clipping compares the true norm with max_norm, so the gradients must be unscaled first.
        scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(params, max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach().float())
    ### END SOLUTION


# The regression head of ``underflow_experiment``: 512 x 32 outputs averaged, and a loss weight of
# 1e-4 (a term kept small beside others, as auxiliary losses are). The gradient reaching each
# output is 2e-4 * residual / 16384, about 1e-8 per unit of residual: below 2^-25 (3e-8), the
# point under which fp16 rounds to zero, for every residual under 2.4 in size. The largest residual
# at initialisation was measured at 1.8 to 2.1 over seeds 0 to 5.
UNDERFLOW_SETUP = {"batch": 512, "d_in": 32, "d_hidden": 64, "d_out": 32, "loss_weight": 1e-4, "lr": 1e-2}


def underflow_experiment(steps: int = 40, scaler=None, seed: int = 0, *, dtype: torch.dtype = torch.float16) -> dict:
    """Train a small regression MLP whose output gradients are ~1e-8, with compute in ``dtype``.

    fp16 under autocast without a scaler: every gradient underflows to zero, the optimizer sees
    nothing, the loss stays where it started. With a scaler (a ``DynamicLossScaler`` or a
    ``torch.amp.GradScaler("cpu")``) the scaled gradients are in range and it trains as fp32
    does (``dtype=torch.float32``: ``train_step_fp32``, no autocast). Adam's step does not depend
    on the gradients' size, so the only thing a scaler changes is whether they are zero. The
    low-precision step is written out here rather than taken from ``train_step_amp``, the lab's
    graded exercise, so that the experiment also runs in the student copy of the package.

    Returns per step ``loss`` (the weighted loss, before the step), ``zero_fraction`` (of all
    parameter gradient elements, as backward left them) and ``scale`` (the scale the step used).
    """
    s = UNDERFLOW_SETUP
    x = checks.randn(s["batch"], s["d_in"], seed=seed)
    teacher = checks.randn(s["d_in"], s["d_out"], seed=seed + 1, scale=s["d_in"] ** -0.5)
    target = torch.tanh(x @ teacher)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(s["d_in"], s["d_hidden"]), nn.Tanh(), nn.Linear(s["d_hidden"], s["d_out"]))
    optimizer = torch.optim.Adam(model.parameters(), lr=s["lr"])
    # No scaler is a disabled one: it passes the loss and the step through untouched.
    scaler = torch.amp.GradScaler("cpu", enabled=False) if scaler is None else scaler
    zeros = []
    for p in model.parameters():
        # Seen as backward finishes each gradient, before any unscaling: dividing by the scale
        # turns no zero into a non-zero, nor (in fp32) the reverse.
        p.register_post_accumulate_grad_hook(lambda p: zeros.append((int((p.grad == 0).sum()), p.grad.numel())))

    def loss_fn(pred, y):
        return s["loss_weight"] * F.mse_loss(pred, y)

    out = {"loss": [], "zero_fraction": [], "scale": []}
    for _ in range(steps):
        out["scale"].append(scaler.get_scale())
        if dtype == torch.float32:
            loss = train_step_fp32(model, optimizer, x, target, loss_fn)
        else:
            with torch.autocast("cpu", dtype=dtype):
                weighted = loss_fn(model(x), target)
            scaler.scale(weighted).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            loss = float(weighted.detach().float())
        out["loss"].append(loss)
        out["zero_fraction"].append(sum(z for z, _ in zeros) / sum(n for _, n in zeros))
        zeros.clear()
    return out
