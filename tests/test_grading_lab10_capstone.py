"""Lab 10's grading on the parent's side: what each verdict rests on is the grader's own figure
(the reference block's outputs, the held-out loss of the returned weights, the measured memory)."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from autograder.labs import lab10_capstone as lab
from fastdl_lab.capstone import accounting, model as capstone_model

SMALL_TRAINING = {"steps": 6, "batch": 4, "sizes": {"seq_len": 24, "d_model": 32, "n_head": 2, "n_layer": 1}}


class NotCausal(capstone_model.Block):
    """The package's block with attention over every position: the mistake the checks name."""

    def __init__(self, config, layernorm, attention):
        super().__init__(config, layernorm, lambda q, k, v: F.scaled_dot_product_attention(q, k, v))


def test_the_block_check_passes_the_reference_and_names_a_missing_mask():
    inputs = lab.block_inputs(3, {"cases": [[32, 2, 11, 2], [24, 3, 9, 1]]})
    assert lab.block_check(inputs, lab.block_drive({"Block": capstone_model.Block}, inputs), {}).fraction == 1
    verdict = lab.block_check(inputs, lab.block_drive({"Block": NotCausal}, inputs), {})
    assert verdict.fraction == 0 and "causal mask" in verdict.reason
    # Anything else that comes back fails with its type named, and the batch goes on.
    assert lab.block_check(inputs, "forged", {}).fraction == 0
    assert lab.block_check(inputs, [{"y": 1}, None], {}).fraction == 0


def test_a_missing_gradient_is_named():
    inputs = lab.block_inputs(4, {"cases": [[16, 2, 5, 1]]})
    outputs = lab.block_drive({"Block": capstone_model.Block}, inputs)
    del outputs[0]["grads"]["mlp.fc.weight"]
    verdict = lab.block_check(inputs, outputs, {})
    assert verdict.fraction == 0 and "mlp.fc.weight" in verdict.reason


def test_the_training_check_computes_the_loss_itself_and_sees_another_run():
    inputs = lab.training_inputs(7, SMALL_TRAINING)
    honest = lab.training_check(inputs, lab.training_drive({"Block": capstone_model.Block}, inputs), {})
    assert honest.fraction == 1 and honest.details["drift"] < 1e-3
    other = lab.training_check(inputs, lab.training_drive({"Block": NotCausal}, inputs), {})
    assert other.fraction == 0 and other.details["drift"] > 0.05
    # The initial weights handed back: no training, a loss the grader computes far from the band.
    untrained = lab.training_check(inputs, {k: v.clone() for k, v in inputs["state"].items()}, {})
    assert untrained.fraction == 0
    missing = lab.training_check(inputs, {"tok_emb.weight": torch.zeros(3)}, {})
    assert missing.fraction == 0 and "lack" in missing.reason


def test_the_memory_check_measures_and_refuses_what_no_comparison_holds():
    inputs = lab.memory_inputs(11, {"cases": 3})
    right = [accounting.predict_memory_ref(lab._config(c["sizes"]), c["batch"], c["attention"], c["recompute_blocks"])
             for c in inputs["cases"]]
    assert lab.memory_check(inputs, right, {}).fraction == 1
    nan = [{p: math.nan for p in accounting.PARTS}] * 3
    assert lab.memory_check(inputs, nan, {}).fraction == 0
    no_activations = [{**r, "activations": 0} for r in right]
    verdict = lab.memory_check(inputs, no_activations, {})
    assert verdict.fraction == 0 and "activations" in verdict.reason
    assert lab.memory_check(inputs, [["weights"], "x", None], {}).fraction == 0


def test_the_speed_item_races_the_students_blocks_against_the_packages_on_the_same_kernels():
    sizes = {"sizes": {"seq_len": 16, "d_model": 32, "n_head": 2, "n_layer": 1}, "batch": 2}
    inputs = lab.speed_inputs(1, sizes)
    inputs["sizes"]["vocab_size"] = 256
    call = {k: v % 256 for k, v in lab.speed_call(1, sizes, 0).items()}
    got = lab.speed_candidate({"Block": capstone_model.Block}, inputs)(call)
    want = lab.speed_baseline({}, inputs)(call)
    assert got.numel() == 1 and abs(got.item() - want.item()) < 1e-5


def test_a_part_left_out_of_the_student_copy_falls_back_to_torchs_and_says_so(monkeypatch):
    def stub(q, k, v):
        raise NotImplementedError("part of a graded exercise: see the lab notebook")

    monkeypatch.setitem(capstone_model.ATTENTIONS, "course-pytorch", stub)
    part, what = capstone_model.usable_part("attention", "course-pytorch")
    assert part == "torch" and "left out of your copy" in what
    assert capstone_model.usable_part("layernorm", "course-pytorch") == ("course-pytorch",
                                                                         "the package's 'course-pytorch'")
    assert capstone_model.usable_part("attention", stub)[1] == "your own function"


def test_the_scope_gives_the_block_what_its_constructor_uses():
    scope: dict = {}
    exec(lab.SCOPE, scope)
    assert {"torch", "F", "nn", "math", "GPTConfig", "LayerNorm"} <= set(scope)
    assert isinstance(scope["nn"].Linear(2, 2), nn.Module)


def test_outputs_of_another_dtype_or_shape_fail_by_name_without_stopping_the_check():
    inputs = lab.block_inputs(5, {"cases": [[16, 2, 5, 1], [16, 2, 6, 1]]})
    outputs = lab.block_drive({"Block": capstone_model.Block}, inputs)
    outputs[0]["y"] = outputs[0]["y"].double()
    outputs[1]["y"] = outputs[1]["y"][:, :2]
    verdict = lab.block_check(inputs, outputs, {})
    assert verdict.fraction == 0 and "dtype" in verdict.reason
