"""A training step of the capstone model: train, time, and account for its memory (lab 10).

- ``make_optimizer``: AdamW as torch's (``"torch"``) or the course's (``"course-foreach"``: lab 04's
  ``torch._foreach`` AdamW, no Triton; ``"course-fused"``: lab 04's one-launch Triton kernel, the
  GPU path), one contract (``torch.optim.AdamW``'s), the same hyper-parameters;
- ``train``: ``steps`` steps on the byte stream, the losses kept on the device and read once at
  the end (lab 06: a ``.item()`` per step is a synchronisation per step);
- ``step_throughput``: one full step (zero_grad, forward, backward, optimizer) timed by the course's
  harness: seconds, tokens/s and, given a peak, the model FLOPs utilisation (MFU: the matmul FLOPs
  a step must do, over the time, over the peak; lab 00);
- ``memory_split``: after a step, the bytes of the weights, the gradients and the optimizer's state
  (counted by storage, each once: the tied embedding is one matrix), and the activations the
  forward saves for the backward, parameters left out (they are the weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastdl_lab.capstone import data
from fastdl_lab.capstone.model import GPT, matmul_flops_per_token

HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
OPTIMIZERS = ("torch", "course-foreach", "course-fused")


def make_optimizer(model: GPT, name: str = "torch", **overrides) -> torch.optim.Optimizer:
    """AdamW over the model's parameters (the tied matrix once), ``HYPER`` unless overridden."""
    hyper = {**HYPER, **overrides}
    params = list(model.parameters())
    if name == "torch":
        return torch.optim.AdamW(params, foreach=True, **hyper)
    if name in ("course-foreach", "course-fused"):
        from fastdl_lab import optim

        return optim.AdamW(params, impl=name.removeprefix("course-"), **hyper)
    raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")


def _step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(model: GPT, optimizer: torch.optim.Optimizer, steps: int, batch_size: int, *, seed: int = 0,
          log: Callable[[str], None] | None = None, log_every: int = 50) -> list[float]:
    """``steps`` steps on the training split; the loss of every step, read after the last one."""
    device = next(model.parameters()).device
    losses = []
    for i, (x, y) in enumerate(data.batches("train", steps, batch_size, model.config.seq_len, seed, device)):
        losses.append(_step(model, optimizer, x, y))
        if log is not None and (i + 1) % log_every == 0:
            log(f"step {i + 1}/{steps}")  # no loss printed: that would wait for the device every time
    return torch.stack(losses).tolist()


@torch.no_grad()
def validation_loss(model: GPT, batch_size: int, batches: int = 4, seed: int = 1) -> float:
    device = next(model.parameters()).device
    losses = [model(x, y)[1] for x, y in data.batches("val", batches, batch_size, model.config.seq_len, seed, device)]
    return torch.stack(losses).mean().item()


def step_flops(model: GPT, batch_size: int) -> int:
    """Matmul FLOPs of one training step: three times the forward's (``matmul_flops_per_token``)."""
    return 3 * matmul_flops_per_token(model.config)["total"] * batch_size * model.config.seq_len


def step_throughput(model: GPT, optimizer: torch.optim.Optimizer, batch_size: int, *, reps: int = 10,
                    peak_flops: float | None = None, seed: int = 0) -> dict:
    """One full step timed by ``timing.bench`` on one batch: ``seconds`` (median), ``tokens_per_s``,
    ``flops`` per step and ``mfu`` against ``peak_flops`` (FLOP/s; None without one)."""
    from fastdl_lab import timing

    device = next(model.parameters()).device
    x, y = next(data.batches("train", 1, batch_size, model.config.seq_len, seed, device))
    t = timing.bench(lambda: _step(model, optimizer, x, y), warmup=2, reps=reps)
    flops = step_flops(model, batch_size)
    return {"seconds": t.median, "timing": t, "tokens_per_s": batch_size * model.config.seq_len / t.median,
            "flops": flops, "mfu": flops / t.median / peak_flops if peak_flops else None}


def memory_split(model: GPT, optimizer: torch.optim.Optimizer, batch_size: int, seed: int = 0) -> dict[str, int]:
    """Bytes after one step: ``weights``, ``grads``, ``optimizer`` (AdamW's two moments; the
    per-tensor step counters left out), and ``activations``: every storage the next forward saves
    for its backward, parameters excluded, each storage once (``memory.saved_tensor_bytes``'s rule)."""
    from fastdl_lab import memory
    from fastdl_lab.amp.memory import training_bytes

    device = next(model.parameters()).device
    x, y = next(data.batches("train", 1, batch_size, model.config.seq_len, seed, device))
    _step(model, optimizer, x, y)
    held = training_bytes(model, optimizer)  # lab 04's count, per parameter: back to bytes
    weights = {memory._storage_key(p) for p in model.parameters()}
    _, saved = memory._saved_storages(lambda: model(x, y)[1], ())
    return {"weights": round(held["params"] * held["numel"]), "grads": round(held["grads"] * held["numel"]),
            "optimizer": round(held["optimizer"] * held["numel"]),
            "activations": sum(n for key, n in saved.items() if key not in weights)}
