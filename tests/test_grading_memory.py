"""The memory items of labs 02 and 05 (``convbn_memory``, ``attention_memory``, ``flash_torch``):
their verdicts rest on the peak of the child's cgroup on the graded call, against a reference child.

The checks are tested here on outputs the course's own code makes in this process, with the peaks
handed in; then two items are graded for real, at small sizes and with a margin to match, through
the sandbox: the reference solution keeps its points, a naive one loses the memory points to a
peak the grader measured, not to anything the child said.
"""

from __future__ import annotations

import pytest
import torch

from autograder.engine.items import Observed, load_lab
from autograder.labs import _common
from autograder.labs import _attention_torch as flash_item
from autograder.labs import lab02_fusion as lab02
from autograder.labs import lab05_attention as lab05
from fastdl_lab import attention, fusion

MIB = 1 << 20
CONVBN = {"cases": [[2, 3, 4, 6, 7, 3, 1, 1, 1e-5], [2, 3, 5, 9, 9, 3, 2, 0, 1e-3]], "chain": [6, 1, 3, 16],
          "peak_margin_mb": 64}
WIRING = {"shape": [1, 1, 192, 16], "blocks": [64, 64], "peak_margin_mb": 64}
FLASH = {"cases": [[1, 2, 37, 16, 0, 16], [1, 1, 50, 16, 1, 32]], "memory": [1, 1, 300, 16, 64], "peak_margin_mb": 64}


def observed(excess_mib: float, source: str = "cgroup") -> Observed:
    """A child that peaked ``excess_mib`` above a reference child of 500 MiB."""
    return Observed(peak_bytes=int((500 + excess_mib) * MIB), peak_source=source,
                    reference={"peak_bytes": 500 * MIB, "peak_source": source, "status": "ok"})


@pytest.fixture(autouse=True)
def _allocator_left_alone(monkeypatch):
    # The drives fix glibc's mmap threshold for their child; this process keeps its own.
    monkeypatch.setattr(_common, "exact_peaks", lambda threshold=None: None)


def test_a_peak_within_the_margin_passes_and_one_above_it_fails_with_the_figures():
    ok, reason, figures = _common.peak_verdict(observed(63), {"peak_margin_mb": 64}, "at N=8", "a lot")
    assert ok and "63 MiB above the course's implementation at N=8 (allowed 64 MiB above)" in reason
    ok, reason, figures = _common.peak_verdict(observed(65), {"peak_margin_mb": 64}, "at N=8", "a lot")
    assert not ok and "65 MiB above" in reason and "a lot" in reason
    assert figures["peak_excess_bytes"] == 65 * MIB and figures["peak_source"] == "cgroup"
    assert _common.peak_verdict(observed(-3), {}, "at N=8", "")[0]


def test_a_sampled_peak_says_what_it_cannot_see_and_a_missing_one_passes_nothing():
    ok, reason, _ = _common.peak_verdict(observed(10, source="sampled"), {}, "at N=8", "")
    assert ok and "no memory cgroup" in reason and "shorter spike is not seen" in reason
    ok, reason, _ = _common.peak_verdict(Observed(peak_bytes=0, reference={"peak_bytes": 500 * MIB}), {}, "at N=8", "")
    assert not ok and "could not be measured" in reason


# --- lab 02: ConvBN ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def convbn_inputs():
    return lab02.convbn_inputs(3, CONVBN)


def test_convbn_with_recompute_near_the_references_peak_earns_every_point(convbn_inputs):
    outputs = lab02.convbn_drive({"conv_bn_train": fusion.conv_bn_train}, convbn_inputs)
    verdict = lab02.convbn_check(convbn_inputs, outputs, CONVBN, observed=observed(5))
    assert verdict.fraction == 1, verdict.reason
    assert verdict.details["conv_outputs_bytes"] == 6 * 3 * 16 * 16 * 4


def test_convbn_that_keeps_the_conv_output_keeps_only_the_values_point(convbn_inputs):
    """Conv -> BN is right in every value: what it loses is the memory, as measured outside; what its
    own process counted comes with the reason, as a hint."""
    outputs = lab02.convbn_drive({"conv_bn_train": fusion.conv_bn_train_ref}, convbn_inputs)
    recompute = lab02.convbn_drive({"conv_bn_train": fusion.conv_bn_train}, convbn_inputs)
    assert outputs["saved_bytes"] > recompute["saved_bytes"]
    verdict = lab02.convbn_check(convbn_inputs, outputs, CONVBN, observed=observed(150))
    assert verdict.fraction == pytest.approx(1 / 3)
    assert "150 MiB above" in verdict.reason and "recompute the convolution" in verdict.reason
    assert "self-reported, not scored" in verdict.reason


def test_convbn_with_a_wrong_gradient_scores_nothing_whatever_its_memory(convbn_inputs):
    def unbiased(x, w, gamma, beta, eps=1e-5, stride=1, padding=1):
        y = torch.nn.functional.conv2d(x, w, None, stride, padding)
        mean, var = y.mean(dim=(0, 2, 3), keepdim=True), y.var(dim=(0, 2, 3), keepdim=True)
        return (y - mean) * torch.rsqrt(var + eps) * gamma[:, None, None] + beta[:, None, None]

    outputs = lab02.convbn_drive({"conv_bn_train": unbiased}, convbn_inputs)
    verdict = lab02.convbn_check(convbn_inputs, outputs, CONVBN, observed=observed(0))
    assert verdict.fraction == 0 and "case 0" in verdict.reason


# --- lab 05: the autograd wiring around the forward kernel ------------------------------------

def test_the_stand_in_backward_gives_the_backward_kernels_gradients():
    q, k, v, do = (torch.randn(2, 70, 16, generator=torch.Generator().manual_seed(i)) for i in range(4))
    config = attention.default_config(16, torch.float32, None, 32, 32)
    o, lse = attention.launch_forward(attention.KERNELS["fwd"], q, k, v, True, 0.25, config)
    want = attention.launch_backward(attention.KERNELS, q, k, v, o, lse, do, True, 0.25, config)
    from autograder.labs._attention_memory import attention as view, host_backward

    got = host_backward(None, q, k, v, o, lse, do, True, 0.25, None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert view.launch_backward is host_backward and view.launch_forward is attention.launch_forward


@pytest.fixture(scope="module")
def wiring_inputs():
    return lab05.memory_inputs(5, WIRING)


def _wiring_outputs(inputs, function, monkeypatch):
    from autograder.labs._attention_memory import host_backward
    from fastdl_lab.attention import function as module

    monkeypatch.setattr(module, "launch_backward", host_backward)
    return lab05.memory_drive({"attn_fwd_kernel": attention.KERNELS["fwd"], "FlashAttention": function}, inputs)


def test_the_courses_wiring_passes_and_its_gradients_are_checked(wiring_inputs, monkeypatch):
    outputs = _wiring_outputs(wiring_inputs, attention.FlashAttentionFunction, monkeypatch)
    verdict = lab05.memory_check(wiring_inputs, outputs, WIRING, observed=observed(2))
    assert verdict.fraction == 1, verdict.reason
    swapped = [{**r, "grads": [r["grads"][0], r["grads"][2], r["grads"][1]]} for r in outputs]
    verdict = lab05.memory_check(wiring_inputs, swapped, WIRING, observed=observed(2))
    assert verdict.fraction == 0 and "dk" in verdict.reason


def test_wiring_that_saves_the_scores_loses_the_item_to_the_peak(wiring_inputs, monkeypatch):
    class KeepsScores(attention.FlashAttentionFunction):
        @staticmethod
        def forward(ctx, q, k, v, is_causal=False, scale=None, kernels=None, config=None):
            out = attention.FlashAttentionFunction.forward(ctx, q, k, v, is_causal, scale, kernels, config)
            ctx.scores = q @ k.transpose(-2, -1)
            return out

    outputs = _wiring_outputs(wiring_inputs, KeepsScores, monkeypatch)
    # The scores sit on ctx, where a count of saved tensors sees them: the hint says so.
    assert outputs[-1]["saved_bytes"] >= 192 * 192 * 4
    verdict = lab05.memory_check(wiring_inputs, outputs, WIRING, observed=observed(100))
    assert verdict.fraction == 0 and "100 MiB above" in verdict.reason and "N x N fp32 matrix" in verdict.reason


# --- lab 05: FlashAttention in PyTorch ----------------------------------------------------------

@pytest.fixture(scope="module")
def flash_inputs():
    return flash_item.inputs(7, FLASH)


def test_flash_torch_half_points_each_for_values_and_for_the_peak(flash_inputs):
    outputs = flash_item.drive({flash_item.CLASS: attention.FlashAttentionTorch}, flash_inputs)
    assert flash_item.check(flash_inputs, outputs, FLASH, observed=observed(1)).fraction == 1
    verdict = flash_item.check(flash_inputs, outputs, FLASH, observed=observed(80))
    assert verdict.fraction == 0.5 and "forward and gradients correct on all 2 cases" in verdict.reason
    assert "80 MiB above" in verdict.reason and f"at N={flash_item.HINT_N} your process counted" in verdict.reason


def test_flash_torch_memory_case_must_be_right_to_earn_its_peak(flash_inputs):
    outputs = flash_item.drive({flash_item.CLASS: attention.FlashAttentionTorch}, flash_inputs)
    memory = outputs["memory"]
    wrong = {**outputs, "memory": {**memory, "grads": [memory["grads"][0] * 1.01, *memory["grads"][1:]]}}
    verdict = flash_item.check(flash_inputs, wrong, FLASH, observed=observed(0))
    assert verdict.fraction == 0.5 and "the memory case is wrong" in verdict.reason


# --- measured for real: the sandbox, the cgroup and a reference child -----------------------------

def _memory_cgroup() -> bool:
    from autograder.engine.jail import Jail

    jail = Jail.create()
    try:
        return jail is not None and jail.peak_bytes() is not None
    finally:
        if jail is not None:
            jail.kill_all()


SMALL = {
    # Small enough to grade in about a second a child, large enough that the memory case is the
    # child's peak and what the naive implementation holds there (the chain's conv outputs, 48 MiB;
    # a 3072 x 3072 fp32 matrix, 36 MiB) stands far from the few MiB two runs of one implementation
    # differ by.
    ("02_fusion", "convbn_memory"): {**CONVBN, "chain": [12, 1, 4, 512], "peak_margin_mb": 16},
    ("05_attention", "flash_torch"): {**FLASH, "memory": [1, 1, 3072, 16, 64], "peak_margin_mb": 16},
}


@pytest.mark.slow
@pytest.mark.skipif(not _memory_cgroup(), reason="no writable memory cgroup on this OS")
@pytest.mark.parametrize("lab, item, naive", [
    ("02_fusion", "convbn_memory", "02_fusion-ctx-keeps-activation"),
    ("05_attention", "flash_torch", "05_attention-torch-untiled-forward"),
])
def test_measured_the_reference_keeps_its_points_and_the_naive_loses_the_memory_ones(course, cpu, lab, item, naive):
    from pathlib import Path

    from autograder.engine.grade import grade_submission
    from autograder.submissions import make_submission, reference_solutions, variant

    labs = {**cpu["labs"], lab: {**cpu["labs"][lab], item: SMALL[(lab, item)]}}
    profile = {**cpu, "labs": labs}
    spec = load_lab(lab)
    fixture = Path(__file__).resolve().parent / "adversarial" / f"{naive}.py"
    submissions = {"reference": make_submission(course, lab, "memory-reference", reference_solutions(course, lab)),
                   "naive": variant(course, lab, f"memory-{naive}", fixture)}
    results = {who: grade_submission(spec, path, release=course.release(lab), profile=profile, seed=5,
                                     student_package=course.student_package, only={item})[0]
               for who, path in submissions.items()}
    honest, naive_result = results["reference"], results["naive"]
    assert honest.status == "passed" and honest.score == honest.max_score, honest.reason
    assert honest.details["peak_source"] == "cgroup"
    assert abs(honest.details["peak_excess_bytes"]) < 3 * MIB, honest.details
    assert naive_result.status == "partial" and naive_result.score < naive_result.max_score, naive_result.reason
    assert naive_result.details["peak_excess_bytes"] > 32 * MIB and "above the course's" in naive_result.reason


def test_a_reference_run_that_failed_runs_again_and_one_that_delivered_is_kept(monkeypatch, cpu):
    """A reference child that failed once (a machine briefly short of time) must not leave every
    later submission of the grading process not graded; one that delivered serves them all."""
    from pathlib import Path

    from autograder.engine import channel, grade
    from autograder.engine.sandbox import ChildResult

    runs = []

    def child(work, limits, sandbox, *args, **kwargs):
        runs.append(work.job["reference"])
        ok = len(runs) > 1
        result = ChildResult("ok" if ok else "timeout", "" if ok else "wall-time limit", 0 if ok else -9, 1.0,
                             peak_bytes=300 * MIB, peak_source="cgroup")
        return grade._Run(result, channel.Received(outputs=[{}] if ok else []))

    monkeypatch.setattr(grade, "_run_child", child)
    monkeypatch.setattr(grade, "_REFERENCE_FIGURES", {})
    spec = load_lab("02_fusion")
    item = spec.item("convbn_memory")
    sandbox = grade.Sandbox(Path("."), {**cpu, "name": "test-reference"})
    first = grade.reference_figures(spec, item, CONVBN, sandbox)
    assert first["status"] == "failed" and "wall-time" in first["reason"]
    again = grade.reference_figures(spec, item, CONVBN, sandbox)
    assert again["status"] == "ok" and again["peak_bytes"] == 300 * MIB
    assert grade.reference_figures(spec, item, CONVBN, sandbox) is again and runs == [True, True]
