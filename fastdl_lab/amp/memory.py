"""Bytes per parameter of a training recipe: on paper (``bytes_per_param_ref``) and as allocated
(``training_bytes``).

A recipe names the dtype of each per-parameter tensor training keeps: the parameters the model
computes with, their gradients, an optional master copy the optimizer updates, and the
optimizer's moments. Activations are not counted: they scale with the batch, not the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn as nn

from fastdl_lab.amp.formats import FORMATS

DTYPE_BYTES: dict[str, int] = {**{name: fmt.storage_bytes for name, fmt in FORMATS.items()}, "int8": 1}
MOMENTS: dict[str, int] = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
# 8-bit optimizers quantise each block of a moment against the block's largest magnitude, stored
# once per block as an fp32 number (bitsandbytes uses blocks of 2048).
DEFAULT_INT8_BLOCK = 2048

RECIPES: dict[str, dict] = {
    "fp32_adam": {"param": "fp32", "grad": "fp32", "master": None, "optimizer": "adam", "moments": "fp32"},
    "mixed_fp16_master_adam": {"param": "fp16", "grad": "fp16", "master": "fp32", "optimizer": "adam",
                               "moments": "fp32"},
    # Gradients accumulated in fp32 (over micro-batches, say), so no bf16 gradient is kept.
    "mixed_bf16_master_adam_fp32_grads": {"param": "bf16", "grad": "fp32", "master": "fp32", "optimizer": "adam",
                                          "moments": "fp32"},
    "pure_bf16_adam": {"param": "bf16", "grad": "bf16", "master": None, "optimizer": "adam", "moments": "bf16"},
    "bf16_fp32_moments": {"param": "bf16", "grad": "bf16", "master": None, "optimizer": "adam", "moments": "fp32"},
    "bf16_master_8bit_adam": {"param": "bf16", "grad": "bf16", "master": "fp32", "optimizer": "adam",
                              "moments": "int8", "block": DEFAULT_INT8_BLOCK},
    "sgd_momentum_fp32": {"param": "fp32", "grad": "fp32", "master": None, "optimizer": "sgd_momentum",
                          "moments": "fp32"},
    "sgd_fp32": {"param": "fp32", "grad": "fp32", "master": None, "optimizer": "sgd", "moments": None},
}

_KEYS = ("param", "grad", "master", "optimizer", "moments")


def validate_recipe(recipe: Mapping) -> None:
    """Raise ValueError naming the offending key of a malformed recipe."""
    if not isinstance(recipe, Mapping):
        raise ValueError(f"a recipe is a dict with keys {list(_KEYS)}, got {type(recipe).__name__}")
    for key in _KEYS:
        if key not in recipe:
            raise ValueError(f"recipe has no {key!r} key; a recipe needs {list(_KEYS)}")
    unknown = sorted(set(recipe) - set(_KEYS) - {"block"})
    if unknown:
        raise ValueError(f"recipe has unknown key(s) {unknown}; the keys are {list(_KEYS)} and 'block'")
    if recipe["optimizer"] not in MOMENTS:
        raise ValueError(f"recipe key 'optimizer' is {recipe['optimizer']!r}; expected one of {sorted(MOMENTS)}")
    dtype_keys = ["param", "grad"] + [k for k in ("master", "moments") if recipe[k] is not None]
    if MOMENTS[recipe["optimizer"]] and recipe["moments"] is None:
        raise ValueError(f"recipe key 'moments' is None, but {recipe['optimizer']!r} keeps moments")
    for key in dtype_keys:
        if recipe[key] not in DTYPE_BYTES:
            raise ValueError(f"recipe key {key!r} is {recipe[key]!r}; expected one of {sorted(DTYPE_BYTES)}")
    block = recipe.get("block", DEFAULT_INT8_BLOCK)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"recipe key 'block' must be a positive int, got {block!r}")


def bytes_per_param_ref(recipe: Mapping) -> dict[str, float]:
    """Bytes each parameter costs under ``recipe``: ``params``, ``grads``, ``master``, ``optimizer``
    (all moments, with int8 moments' per-block fp32 scales) and their ``total``."""
    validate_recipe(recipe)
    ### BEGIN SOLUTION
    moment_bytes = 0.0
    if recipe["moments"] is not None:
        moment_bytes = float(DTYPE_BYTES[recipe["moments"]])
        if recipe["moments"] == "int8":
            moment_bytes += 4.0 / recipe.get("block", DEFAULT_INT8_BLOCK)
    out = {"params": float(DTYPE_BYTES[recipe["param"]]), "grads": float(DTYPE_BYTES[recipe["grad"]]),
           "master": float(DTYPE_BYTES[recipe["master"]]) if recipe["master"] is not None else 0.0,
           "optimizer": MOMENTS[recipe["optimizer"]] * moment_bytes}
    out["total"] = out["params"] + out["grads"] + out["master"] + out["optimizer"]
    return out
    ### END SOLUTION


def training_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, masters: Iterable[torch.Tensor] = ()) -> dict:
    """Bytes per model parameter that are allocated right now, by what holds them.

    Counts whole storages, each once however many tensors view it (tied weights, flat buffers):
    the model's parameters (``params``), the gradients of the parameters and of the ``masters``
    (``grads``), the master copies (``master``) and the tensors in ``optimizer.state``
    (``optimizer``), then divides by the number of model parameters (``numel``). Optimizers keep
    a 0-dimensional ``step`` counter per parameter tensor: a few bytes per tensor, not per
    element, so it is left out of the per-parameter figures and reported in ``step_bytes``.
    """
    seen: set[tuple[torch.device, int]] = set()

    def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    params = list({id(p): p for p in model.parameters()}.values())
    masters = list(masters)
    numel = sum(p.numel() for p in params)
    if numel == 0:
        raise ValueError("the model has no parameters")
    state = [(name, t) for per_param in optimizer.state.values() for name, t in per_param.items()
             if isinstance(t, torch.Tensor)]
    counted = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params + masters if p.grad is not None),
        "master": storage_bytes(masters),
        "optimizer": storage_bytes(t for name, t in state if not (name == "step" and t.dim() == 0)),
    }
    out = {key: value / numel for key, value in counted.items()}
    out["total"] = sum(out.values())
    out["numel"] = numel
    out["step_bytes"] = storage_bytes(t for name, t in state if name == "step" and t.dim() == 0)
    return out
