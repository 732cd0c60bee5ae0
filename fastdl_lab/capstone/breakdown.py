"""Where a training step's FLOPs go against where its time goes, op class by op class (labs 02, 10).

In BERT the matrix multiplies are 99.8% of the FLOPs but about 61% of the time (Ivanov et al.,
"Data Movement Is All You Need", MLSys 2021): the rest of the time goes to operators that do
almost no arithmetic and move a lot of memory (softmax, LayerNorm, the elementwise ops, the
copies). ``flop_time_table`` measures that split for any model and step on this machine:

- FLOPs per op from ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; it
  counts nothing for the other ops, which is the point: their FLOPs are negligible);
- time per op from ``torch.profiler``: each op's *self* time (its own, not its callees'), forward
  and backward, summed over ``steps`` runs after a warm-up;
- both grouped into ``OP_CLASSES`` by the aten op's name, each class's share of the total.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# aten op names (without "aten::") to a class; anything else is "other".
OP_CLASSES = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward", "convolution", "convolution_backward"),
    "softmax": ("_softmax", "softmax", "_softmax_backward_data", "_log_softmax", "log_softmax",
                "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"),
    "layernorm": ("native_layer_norm", "native_layer_norm_backward", "layer_norm"),
    "elementwise": ("add", "add_", "mul", "mul_", "div", "div_", "sub", "gelu", "gelu_backward", "tanh",
                    "tanh_backward", "masked_fill", "masked_fill_", "where", "fill_", "zero_", "copy_", "clone",
                    "addcmul_", "addcdiv_", "sqrt", "lerp_", "neg", "exp", "pow"),
}
CLASSES = (*OP_CLASSES, "other")


def op_class(name: str) -> str:
    """The class of a profiler or FLOP-counter op name (``aten::addmm``, ``aten.addmm.default``)."""
    base = name.removeprefix("aten::").removeprefix("aten.").split(".")[0]
    return next((cls for cls, names in OP_CLASSES.items() if base in names), "other")


def flop_time_table(step: Callable[[], None], steps: int = 3) -> list[dict]:
    """Run ``step`` (a forward and backward, say) once to warm up, once under the FLOP counter and
    ``steps`` times under the profiler. One row per class of ``CLASSES``: ``flops`` (per step),
    ``time_s`` (self CPU time per step), and each as a share of the step's total."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    step()
    flops = dict.fromkeys(CLASSES, 0)
    with FlopCounterMode(display=False) as counter:
        step()
    for op, count in counter.get_flop_counts().get("Global", {}).items():
        flops[op_class(str(op))] += count
    seconds = dict.fromkeys(CLASSES, 0.0)
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            # On a GPU the kernels' time is the one that counts (an op that launches none adds
            # nothing); on a CPU, each op's own time.
            own = event.self_device_time_total if on_gpu else event.self_cpu_time_total
            seconds[op_class(event.key)] += own / 1e6 / steps
    total_flops, total_s = sum(flops.values()) or 1, sum(seconds.values()) or 1.0
    return [{"class": cls, "flops": flops[cls], "flops_share": flops[cls] / total_flops, "time_s": seconds[cls],
             "time_share": seconds[cls] / total_s} for cls in CLASSES]


def training_step(model, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """A forward and backward of ``model(x, y)`` (a loss), gradients dropped after: what the table times."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()

    return step


def plot_shares(rows: list[dict], title: str = ""):
    """Two stacked bars, share of FLOPs and share of time, one colour per op class."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for which, x in (("flops_share", 0), ("time_share", 1)):
        bottom = 0.0
        for i, r in enumerate(rows):
            ax.bar(x, r[which], bottom=bottom, color=f"C{i}", label=r["class"] if x == 0 else None)
            bottom += r[which]
    ax.set_xticks([0, 1], ["share of FLOPs", "share of time"])
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
    ax.set_title(title)
    fig.tight_layout()
    return fig
