"""The capstone's three experiments on a training step, each with its plot (lab 10).

- ``checkpointing_sweep``: activation checkpointing on the first 0, 1, ..., n_layer blocks: the
  activations a step saves against its time (memory bought with recomputation);
- ``precision_runs``: fp32 against bf16 autocast, from the same weights on the same batches: step
  time, saved activations, and the loss curves side by side;
- ``compile_runs``: the model eager and under ``torch.compile``: the first step (which compiles),
  the steps after, and the graph breaks Dynamo reports, by reason.

Each returns plain rows; the ``plot_*`` functions draw them and return the matplotlib Figure.
"""

from __future__ import annotations

import time

import torch

from fastdl_lab.capstone import data, model as capstone_model, step


def _device() -> str:
    from fastdl_lab import device

    return "cuda" if device.has_gpu() else "cpu"


def _fresh(config, seed: int = 0, **parts):
    """The model on this machine's device (the GPU where there is one), and its AdamW."""
    gpt = capstone_model.build(config, seed=seed, device=_device(), **parts)
    return gpt, step.make_optimizer(gpt)


def checkpointing_sweep(config: capstone_model.GPTConfig, batch_size: int, reps: int = 5) -> list[dict]:
    """One row per number of recomputed blocks: ``activation_bytes`` and step ``seconds``."""
    rows = []
    for blocks in range(config.n_layer + 1):
        gpt, opt = _fresh(config)
        gpt.recompute_blocks = blocks
        split = step.memory_split(gpt, opt, batch_size)
        rows.append({"recompute_blocks": blocks, "activation_bytes": split["activations"],
                     "seconds": step.step_throughput(gpt, opt, batch_size, reps=reps)["seconds"]})
    return rows


def precision_runs(config: capstone_model.GPTConfig, batch_size: int, steps: int, reps: int = 5) -> dict[str, dict]:
    """``{"fp32": ..., "bf16 autocast": ...}``, each with ``losses`` (per step, same data and
    weights), step ``seconds`` and ``activation_bytes``. Autocast runs the matmuls in bf16 and keeps
    the weights, the optimizer and the loss in fp32 (lab 04)."""
    out = {}
    for name, dtype in (("fp32", None), ("bf16 autocast", torch.bfloat16)):
        gpt, opt = _fresh(config)
        gpt.autocast_dtype = dtype
        losses = step.train(gpt, opt, steps, batch_size)
        gpt, opt = _fresh(config)
        gpt.autocast_dtype = dtype
        split = step.memory_split(gpt, opt, batch_size)
        seconds = step.step_throughput(gpt, opt, batch_size, reps=reps)["seconds"]
        out[name] = {"losses": losses, "seconds": seconds, "activation_bytes": split["activations"]}
    return out


def compile_runs(config: capstone_model.GPTConfig, batch_size: int, steps: int = 5, backend: str = "inductor",
                 **parts) -> dict:
    """Eager and compiled (the model built with ``parts``): ``first_s`` (the first step,
    compilation included), ``later_s`` (the median of the other steps), and for the compiled model
    ``graphs`` and ``breaks`` (reason -> count) from ``torch._dynamo.explain`` on its forward."""
    import torch._dynamo

    batches = list(data.batches("train", steps, batch_size, config.seq_len, 0, _device()))
    out = {}
    for name in ("eager", "compiled"):
        torch._dynamo.reset()
        gpt, opt = _fresh(config, **parts)
        runner = torch.compile(gpt, backend=backend) if name == "compiled" else gpt
        seconds = []
        for x, y in batches:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            _, loss = runner(x, y)
            loss.backward()
            opt.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        later = sorted(seconds[1:])
        out[name] = {"first_s": seconds[0], "later_s": later[len(later) // 2] if later else None}
    torch._dynamo.reset()
    explained = torch._dynamo.explain(capstone_model.build(config, device=_device(), **parts))(batches[0][0])
    breaks: dict[str, int] = {}
    for reason in explained.break_reasons:
        breaks[reason.reason] = breaks.get(reason.reason, 0) + 1
    out["compiled"].update(graphs=explained.graph_count, breaks=breaks)
    torch._dynamo.reset()
    return out


# --- plots ----------------------------------------------------------------------------------------

def plot_checkpointing(rows: list[dict]):
    """Activation memory (MiB) against step time (ms), one point per number of recomputed blocks."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    mib = [r["activation_bytes"] / 2**20 for r in rows]
    ms = [r["seconds"] * 1e3 for r in rows]
    ax.plot(ms, mib, marker="o")
    for r, x, y in zip(rows, ms, mib):
        ax.annotate(str(r["recompute_blocks"]), (x, y), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel("saved activations (MiB)")
    ax.set_title("activation checkpointing: blocks recomputed")
    fig.tight_layout()
    return fig


def plot_precision(runs: dict[str, dict]):
    """The loss curves of the runs, one line each, labelled with their step time."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, run in runs.items():
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"],
                label=f"{name}: {run['seconds'] * 1e3:.0f} ms/step, {run['activation_bytes'] / 2**20:.1f} MiB saved")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
