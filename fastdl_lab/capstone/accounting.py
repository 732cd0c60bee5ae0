"""A training step's memory, predicted from the model's sizes and measured (lab 10).

The bytes a step holds when its forward ends, in four parts: the weights, the gradients (as large
as the weights, held from the backward to the optimizer's step), AdamW's two moments, and the
activations the forward saved for the backward. The first three are lab 04's bytes per parameter
times the parameter count; the fourth grows with the batch and the sequence, and is the part a
formula has to earn.

- ``measure``: the four parts of the reference model (torch's LayerNorm, the attention named) on
  this machine, after one AdamW step, the activations counted by storage as the forward saves them
  (``step.memory_split``): the figure the lab's graded prediction is judged against;
- ``predict_memory_ref``: the formula, the lab's exercise (a graded region);
- ``plot_split``: measured against predicted, part by part.
"""

from __future__ import annotations

import math

import torch

from fastdl_lab.capstone import model as capstone_model, step

PARTS = ("weights", "grads", "optimizer", "activations")
ATTENTIONS = ("torch", "math")


def measure(config: capstone_model.GPTConfig, batch_size: int, *, attention: str = "torch",
            recompute_blocks: int = 0, seed: int = 0) -> dict[str, int]:
    """The four parts, in bytes, of an fp32 model with torch's AdamW, measured on the CPU."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    gpt = capstone_model.build(config, attention=attention, seed=seed)
    gpt.recompute_blocks = recompute_blocks
    return step.memory_split(gpt, step.make_optimizer(gpt), batch_size, seed=seed)


def predict_memory_ref(config: capstone_model.GPTConfig, batch_size: int, attention: str = "torch",
                       recompute_blocks: int = 0) -> dict[str, int]:
    """The four parts from the sizes alone, fp32, to the byte of what ``measure`` counts."""
    ### BEGIN SOLUTION
    V, T, d, H, L = config.vocab_size, config.seq_len, config.d_model, config.n_head, config.n_layer
    n = batch_size * T  # tokens in the batch
    weights = 4 * capstone_model.param_count(config)
    # A block keeps 16 (n, d) tensors: LayerNorm 1's input and output, the qkv projection (3), the
    # attention's output (the projection reads a view of it, one storage), the residual sum, the
    # second LayerNorm's output, the MLP's hidden layer before and after GELU (4 + 4), LayerNorm 2's
    # input; and each LayerNorm's mean and 1/std per row (2 n floats each).
    block = 4 * (16 * n * d + 4 * n)
    if attention == "torch":
        block += 4 * batch_size * H * T  # the fused kernel's log-sum-exp per row and head
    else:
        block += 4 * batch_size * H * T * T + T * T  # the softmax's (T, T) output per head, the bool mask
    # A recomputed block keeps only its input; the rest of the model: token ids and positions
    # (int64), the last LayerNorm (input, output, statistics), the log-softmax of the logits, the
    # targets (int64), and the loss's 4-byte weight total.
    checkpointed = min(recompute_blocks, L)
    rest = 8 * n + 8 * T + 4 * (2 * n * d + 2 * n) + 4 * n * V + 8 * n + 4
    activations = (L - checkpointed) * block + checkpointed * 4 * n * d + rest
    return {"weights": weights, "grads": weights, "optimizer": 2 * weights, "activations": activations}
    ### END SOLUTION


def relative_errors(predicted: dict, measured: dict) -> dict[str, float]:
    """Per part, |predicted - measured| / measured; a part that is missing, not a number, or not
    finite counts as 1 (NaN would otherwise pass every "above the tolerance?" test)."""
    out = {}
    for part in PARTS:
        value = predicted.get(part) if isinstance(predicted, dict) else None
        try:
            error = abs(float(value) - measured[part]) / max(1, measured[part])
        except (TypeError, ValueError, OverflowError):
            error = 1.0
        out[part] = error if math.isfinite(error) else 1.0
    return out


def plot_split(measured: dict, predicted: dict | None = None, title: str = ""):
    """One bar per part (MiB), measured beside predicted where given."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    xs = range(len(PARTS))
    width = 0.4 if predicted else 0.6
    ax.bar([x - (width / 2 if predicted else 0) for x in xs], [measured[p] / 2**20 for p in PARTS], width,
           label="measured")
    if predicted:
        ax.bar([x + width / 2 for x in xs], [float(predicted.get(p, 0)) / 2**20 for p in PARTS], width,
               label="predicted")
    ax.set_xticks(list(xs), PARTS)
    ax.set_ylabel("MiB")
    ax.set_title(title or "a training step's memory when its forward ends")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    config = capstone_model.GPTConfig(d_model=64, n_layer=2, seq_len=64)
    got, want = measure(config, 4), predict_memory_ref(config, 4)
    print({p: (got[p], want[p]) for p in PARTS})
    torch.testing.assert_close(torch.tensor([got[p] for p in PARTS]), torch.tensor([want[p] for p in PARTS]))
