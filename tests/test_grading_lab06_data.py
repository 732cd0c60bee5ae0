"""Lab 06's checks on what a grading child returns: what each verdict rests on, with the child's
outputs made here by the course's own code (nothing is sandboxed: no student code runs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autograder import profiles
from autograder.engine.items import Observed
from autograder.labs import lab06_data as lab
from fastdl_lab.data import loop

PARAMS = {"items": 128, "steps": 4, "batch_size": 32, "max_len": 128, "ops_ratio": 1.5}


@pytest.fixture(scope="module")
def honest():
    """The inputs of one loop item and what the course's own fixed loop returns for them."""
    inputs = lab.loop_inputs(11, PARAMS)
    outputs = lab.syncs_drive({"make_loader": loop.make_loader, "train_fast": loop.train_fast}, inputs)
    return inputs, outputs


def test_the_fixed_loop_earns_every_point_with_its_workers_seen_from_outside(honest):
    inputs, outputs = honest
    verdict = lab.syncs_check(inputs, outputs, PARAMS, observed=Observed(processes=3))
    assert verdict.fraction == 1, verdict.reason
    assert "seen by the grader" in verdict.reason and "self-reported" in verdict.reason
    alone = lab.syncs_check(inputs, outputs, PARAMS, observed=Observed(processes=1))
    assert alone.fraction == pytest.approx(2 / 3) and "no process beside" in alone.reason


def test_counts_the_child_reports_buy_one_point_at_most(honest):
    """The original loader (padded to the dataset's longest) with counts forged to zero: the grader's
    own check of the batches fails, the workers it saw are not credited to such a loader, and what is
    left is the self-reported point, said so."""
    inputs, outputs = honest
    widest = max(len(s) for s in inputs["probe"])
    padded = [F.pad(tokens, (0, widest - tokens.shape[1])) for tokens in outputs["batches"]]
    forged = {**outputs, "batches": padded, "syncs": 0, "ops": 0, "uploads": 0}
    verdict = lab.syncs_check(inputs, forged, PARAMS, observed=Observed(processes=3))
    assert verdict.fraction == pytest.approx(1 / 3)
    assert "pad each batch to its own longest" in verdict.reason and "self-reported" in verdict.reason


def test_batches_must_be_the_datasets_own_sequences(honest):
    inputs, outputs = honest
    shuffled = [tokens.flip(1) for tokens in outputs["batches"]]
    verdict = lab.syncs_check(inputs, {**outputs, "batches": shuffled}, PARAMS, observed=Observed(processes=3))
    assert verdict.fraction < 1 and "not one of the dataset's sequences" in verdict.reason


def test_nothing_is_graded_of_a_loop_that_does_not_train_as_the_original(honest):
    inputs, outputs = honest
    verdict = lab.syncs_check(inputs, {**outputs, "losses": outputs["losses"] * 2}, PARAMS,
                              observed=Observed(processes=3))
    assert verdict.fraction == 0 and "does not train" in verdict.reason


def _timed(candidate, baseline, candidate_s=0.1, baseline_s=0.2):
    n = len(candidate)
    return Observed(timings={"candidate": candidate, "baseline": baseline, "candidate_s": [candidate_s] * n,
                             "baseline_s": [baseline_s] * n, "withheld": [{}] * n})


def test_a_timed_run_is_judged_against_the_originals_run_of_the_same_call():
    runs = [torch.rand(4) for _ in range(3)]
    honest = lab.loop_speed_check({}, None, {"min_speedup": 1.5}, observed=_timed(runs, [r.clone() for r in runs]))
    assert honest.fraction == 1 and honest.details["speedup"] == pytest.approx(2.0)
    replayed = lab.loop_speed_check({}, None, {"min_speedup": 1.5}, observed=_timed([runs[0]] * 3, runs))
    assert replayed.fraction == 0 and "timed call 1" in replayed.reason
    slow = lab.loop_speed_check({}, None, {"min_speedup": 3.0}, observed=_timed(runs, runs))
    assert slow.fraction == 0 and "needs 3.00x" in slow.reason


def test_each_call_of_the_speed_item_brings_a_seed_of_its_own():
    seeds = {lab.loop_speed_call(5, {}, i)["seed"] for i in range(6)}
    assert len(seeds) == 6 and lab.loop_speed_call(5, {}, 0) == lab.loop_speed_call(5, {}, 0)


def _sampler_run(inputs, batch_of):
    n = len(inputs["lengths"])
    order = sorted(range(n), key=lambda i: int(inputs["lengths"][i]))
    epochs = []
    for e in range(inputs["epochs"]):
        batches = [order[i:i + batch_of] for i in range(0, n, batch_of)]
        shuffle = torch.randperm(len(batches), generator=torch.Generator().manual_seed(e)).tolist()
        epochs.append([batches[b] for b in shuffle])
    return {"len": len(epochs[0]), "epochs": epochs}


def test_a_sampler_of_tiny_batches_fails_whatever_its_padding():
    params = profiles.item_params(profiles.load("cpu"), "06_data", "bucket_sampler")
    inputs = lab.sampler_inputs(3, params)
    tiny = lab.sampler_check(inputs, [_sampler_run(inputs, 2) for _ in inputs["seeds"]], params)
    assert tiny.fraction == 0 and "on average" in tiny.reason
    full = lab.sampler_check(inputs, [_sampler_run(inputs, inputs["batch_size"]) for _ in inputs["seeds"]], params)
    assert "on average" not in full.reason


def test_the_packing_childs_inputs_hold_no_model_seed():
    item = lab.LAB.item("packing")
    assert "model_seed" in item.make_inputs(1, {}) and item.withheld == ("model_seed",)
