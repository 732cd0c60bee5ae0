"""Graded items of lab 04 mixed precision: bytes per parameter, a dynamic loss scaler, an AMP
training step, a one-launch fused AdamW kernel and the optimizer around it.

Every item here grades extracted code: the student's classes and functions are screened and run
on their own (``Item.artefacts``), the kernel on its own (``Item.kernels``). No other code of the
notebook runs in the grading child. The verdicts rest on values the parent recomputes from the
hidden inputs (bytes, scales, skipped steps, parameters against ``torch.amp.GradScaler`` and
``torch.optim.AdamW``). The optimizer's launches and torch ops per step are counted in the child
by stand-ins next to the student's code: self-reported, one point at most. The library rule (no
``torch.amp`` scaler, no ``torch.optim`` AdamW, no fused or ``_foreach`` kernels of torch's) is the
artefact screen's, and the child's: before the student's code exists, it refuses the library's
ops at torch's dispatcher (``autograder/labs/_refusals.py``).
"""

from __future__ import annotations

from autograder.engine.items import Item, LabSpec
from autograder.labs.lab04_mixed_precision.adamw import (KERNEL, adamw_check, adamw_drive, adamw_inputs,
                                                         optimizer_check, optimizer_drive, optimizer_inputs,
                                                         speed_baseline, speed_check, speed_inputs, speed_timed)
from autograder.labs.lab04_mixed_precision.scaling import (bytes_check, bytes_drive, bytes_inputs, scaler_check,
                                                           scaler_drive, scaler_inputs, step_check, step_drive,
                                                           step_inputs)
from autograder.labs.lab04_mixed_precision.shared import LIBRARY, SCOPE, refusing

LAB = LabSpec(
    name="04_mixed_precision",
    preamble="from fastdl_lab import device\n",
    items=[
        Item("bytes_per_param", 2, ("memory_code",), bytes_inputs, bytes_drive, bytes_check,
             artefacts=("bytes_per_param",), scope=SCOPE, library=LIBRARY,
             description="bytes per parameter of params, grads, master weights and optimizer state"),
        Item("loss_scaler", 3, ("scaler_code",), scaler_inputs, scaler_drive, scaler_check, kind="mechanism",
             artefacts=("DynamicLossScaler",), scope=refusing("refuse_amp_scaler"), library=LIBRARY,
             description="a dynamic loss scaler, step for step against torch.amp.GradScaler on scripted overflows"),
        Item("amp_train_step", 2, ("train_step_code",), step_inputs, step_drive, step_check,
             artefacts=("train_step",), scope=SCOPE, library=LIBRARY,
             description="bf16 autocast step: scale, unscale before clipping, step, update"),
        Item("fused_adamw", 4, ("adamw_kernel_code",), adamw_inputs, adamw_drive, adamw_check, kernels=(KERNEL,),
             description="the one-launch AdamW kernel against torch.optim.AdamW: fp32, bf16/fp16 with fp32 masters"),
        Item("fused_adamw_launches", 2, ("adamw_kernel_code", "adamw_optimizer_code"), optimizer_inputs,
             optimizer_drive, optimizer_check, kind="mechanism", kernels=(KERNEL,), artefacts=("FusedAdamW",),
             scope=refusing("refuse_fused_adam"), library=LIBRARY,
             description="the optimizer class: torch.optim.AdamW's values on many tensors and parameter groups "
                         "(checked by the grader), one kernel launch per step (self-reported)"),
        Item("fused_adamw_speed", 2, ("adamw_kernel_code",), speed_inputs, kind="speed", check=speed_check,
             timed=speed_timed, baseline=speed_baseline, kernels=(KERNEL,),
             description="fused step vs torch foreach AdamW (GPU profiles)"),
    ],
)
