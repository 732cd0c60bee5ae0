"""Lab 09's distillation: the loss (zero at agreement, T**2 scaling, the mix with labels, its
gradient) and the experiment in which the distilled student beats the hard-label one."""

import pytest
import torch
import torch.nn.functional as F

from fastdl_lab import checks, distill


def test_the_loss_is_zero_when_the_student_agrees_and_positive_otherwise():
    t = checks.randn(8, 10, seed=1)
    assert distill.distillation_loss_ref(t.clone(), t).abs() < 1e-6
    assert distill.distillation_loss_ref(checks.randn(8, 10, seed=2), t) > 0


def test_temperature_scaling_and_the_mix_with_labels():
    s, t = checks.randn(16, 10, seed=3), checks.randn(16, 10, seed=4)
    y = torch.randint(0, 10, (16,))
    kl = F.kl_div(F.log_softmax(s / 3, -1), F.softmax(t / 3, -1), reduction="batchmean")
    torch.testing.assert_close(distill.distillation_loss_ref(s, t, temperature=3.0), 9 * kl)
    torch.testing.assert_close(distill.distillation_loss_ref(s, t, y, alpha=0.0), F.cross_entropy(s, y))
    mixed = distill.distillation_loss_ref(s, t, y, temperature=3.0, alpha=0.25)
    torch.testing.assert_close(mixed, 0.25 * 9 * kl + 0.75 * F.cross_entropy(s, y))
    with pytest.raises(ValueError, match="targets"):
        distill.distillation_loss_ref(s, t, alpha=0.5)
    with pytest.raises(ValueError):
        distill.distillation_loss_ref(s, t, temperature=0)


def test_the_gradient_is_the_softened_difference_and_the_teacher_gets_none():
    s = checks.randn(4, 6, seed=5).requires_grad_()
    t = checks.randn(4, 6, seed=6).requires_grad_()
    distill.distillation_loss_ref(s, t, temperature=2.0).backward()
    # d/ds of T^2 KL / batch: T * (softmax(s/T) - softmax(t/T)) / batch
    expected = 2.0 * (F.softmax(s / 2, -1) - F.softmax(t / 2, -1)).detach() / 4
    torch.testing.assert_close(s.grad, expected)
    assert t.grad is None


def test_the_digits_are_scikit_learns():
    x, y, x_test, y_test = distill.digits_split(0)
    assert x.shape == (1200, 64) and x_test.shape == (597, 64)
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0 and set(y.tolist()) == set(range(10))
    x1, y1, _, _ = distill.digits_split(1)
    assert not torch.equal(y1, y)  # another seed, another split


def test_distillation_beats_hard_labels_on_a_small_transfer_set():
    # The lab's quick configuration; measured on seeds 0-4 it gained 2.5 to 7.9 points.
    kd = distill.experiment(0, teacher_sizes=(64, 64, 10), teacher_steps=80, student_steps=100)
    assert kd["teacher"] > 0.9
    assert kd["distilled"] > kd["hard labels"] + 0.02
    assert kd["params"] == {"teacher": 64 * 64 + 64 + 64 * 10 + 10, "student": 64 * 16 + 16 + 16 * 10 + 10}
