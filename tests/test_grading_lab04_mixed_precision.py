"""Lab 04's grading on the parent's side: what each verdict rests on, and the library refused at
torch's dispatcher in a grading child (``autograder/labs/_refusals.py``)."""

import subprocess
import sys

import torch

from autograder.engine.items import load_lab
from autograder.labs.lab04_mixed_precision import adamw, scaling
from fastdl_lab.amp import train_step_amp

SMALL = {"steps": 2, "tensor_counts": [3, 7], "group_tensors": 6}


def _outputs(inputs, per_step, spoil=False):
    runs = []
    for case in inputs["cases"]:
        params = adamw._torch_adamw_case(inputs, case)
        if spoil:
            params = [p + 1e-3 for p in params]
        runs.append({"params": params, "per_step": [list(per_step)] * len(case["grads"])})
    return runs


def test_the_optimizer_point_the_grader_checks_and_the_point_it_is_told():
    inputs = adamw.optimizer_inputs(5, SMALL)
    grouped = inputs["cases"][-1]
    assert len(grouped["groups"]) == 2 and grouped["group_hyper"][1]["weight_decay"] == 0.0 and grouped["frozen"]
    honest = adamw.optimizer_check(inputs, _outputs(inputs, [1, 2]), SMALL)
    assert honest.fraction == 1 and "checked by the grader" in honest.reason and "self-reported" in honest.reason
    # Right values, and a count the child reports of many launches: the grader's point only.
    loops = adamw.optimizer_check(inputs, _outputs(inputs, [7, 2]), SMALL)
    assert loops.fraction == 0.5 and "self-reported" in loops.reason
    # A forged count of one launch is worth nothing without AdamW's values.
    forged = adamw.optimizer_check(inputs, _outputs(inputs, [1, 0], spoil=True), SMALL)
    assert forged.fraction == 0


def test_frozen_tensors_and_groups_follow_torchs_adamw():
    inputs = adamw.optimizer_inputs(5, SMALL)
    case = inputs["cases"][-1]
    after = adamw._torch_adamw_case(inputs, case)
    for i in case["frozen"]:
        assert after[i].equal(case["init"][i])
    moved = [i for i in range(len(after)) if i not in case["frozen"]]
    assert all(not after[i].equal(case["init"][i]) for i in moved)


def test_a_forward_outside_autocast_fails_on_the_losses_the_grader_recomputes():
    inputs = scaling.step_inputs(11, {"steps": 8})

    def step(dtype):
        return lambda m, o, s, x, y, f, clip: train_step_amp(m, o, s, x, y, f, dtype=dtype, max_norm=clip)

    honest = scaling._train(inputs, step(torch.bfloat16))
    assert scaling.step_check(inputs, honest, {}).fraction == 1
    # fp32 all along (CPU autocast does not take float32), with the dtype the child's probe saw
    # forged: the parameters are within their tolerance, the losses are not.
    fp32 = {**scaling._train(inputs, step(torch.float32)), "dtypes": honest["dtypes"]}
    verdict = scaling.step_check(inputs, fp32, {})
    assert verdict.fraction == 0 and "returned losses" in verdict.reason, verdict.reason


_REFUSED = r"""
import math
import torch
from torch import nn
from autograder.engine.items import load_lab
from autograder.labs import _refusals

lab04, lab09 = load_lab("04_mixed_precision"), load_lab("09_custom_ops")
for scope in (lab04.item("loss_scaler").scope, lab04.item("fused_adamw_launches").scope,
              lab09.item("per_channel_int8").scope):
    ns = {}
    exec(scope, ns)  # as a grading child runs it, before the student's definitions exist
    assert not any(name.startswith("_") and not name.startswith("__") for name in ns), sorted(ns)


def refused(call):
    try:
        call()
    except _refusals.LibraryRefused as exc:
        return str(exc)
    return None


p = nn.Parameter(torch.randn(5))
scaler, sgd = torch.amp.GradScaler("cpu"), torch.optim.SGD([p], lr=0.1, momentum=0.9)
scaler.scale(p.sum()).backward()
assert "torch.amp" in refused(lambda: scaler.unscale_(sgd))
assert refused(lambda: torch.optim.AdamW([p], fused=True).step())
assert refused(lambda: torch.optim.AdamW([p], foreach=True).step())
with torch.inference_mode():
    assert refused(lambda: torch._foreach_add_([torch.zeros(2)], 1.0))
w = torch.randn(4, 3)
scales, zeros = torch.ones(4, dtype=torch.double), torch.zeros(4, dtype=torch.long)
assert refused(lambda: torch.quantize_per_channel(w, scales, zeros, 0, torch.qint8))
assert refused(lambda: torch.fake_quantize_per_tensor_affine(w, 0.1, 0, -7, 7))
# What honest solutions and the drivers use still runs.
p.grad.mul_(0.5)
assert bool(torch.isfinite(p.grad).all())
sgd.step()
torch.optim.AdamW([p], foreach=False).step()
assert torch.round(w / 0.1).clamp(-127, 127).to(torch.int8).shape == (4, 3)
print("ok")
"""


def test_the_librarys_ops_are_refused_in_the_child_and_nothing_else():
    # A process of its own: the refusals last for the whole process, as in a grading child.
    done = subprocess.run([sys.executable, "-c", _REFUSED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_amp_train_step_keeps_the_library_scaler_it_is_handed():
    # The step is given torch.amp.GradScaler by the grader: its child refuses nothing.
    assert "_refusals" not in load_lab("04_mixed_precision").item("amp_train_step").scope
