"""Lab 07 distributed: parameter server (sync, async, bounded staleness), ZeRO-1, tensor parallel."""

import pytest
import torch

from fastdl_lab import checks
from fastdl_lab.distributed import ddp, ps, run_world, tensor_parallel, zero

pytestmark = pytest.mark.distributed


def test_bounded_staleness_rule():
    rule = ps.bounded_staleness_rule_ref
    assert rule(5, 5, 0) and not rule(5, 4, 0)
    assert rule(10, 8, 2) and not rule(10, 7, 2)
    assert rule(3, 0, 100)


def test_sync_is_full_batch_gradient_descent():
    steps, lr = 30, 0.3
    result = run_world(ps.run_ps, 3, "sync", 0, steps, lr, 4)[0]
    x, y = ps.make_linear_regression(4, 240, 8)
    w = torch.zeros(8, dtype=torch.float64)
    for _ in range(steps):
        w -= lr * ps.gradient(w, x, y)
    checks.assert_close(result["weights"], w)
    assert result["staleness"] == [0] * (2 * steps) and ps.converged(result)


def test_bounded_never_exceeds_tau_and_converges():
    for tau in (0, 2):
        server, *workers = run_world(ps.run_ps, 3, "bounded", tau, 60, 0.1, 0, worker_delays=[0.002, 0.01])
        assert max(server["staleness"]) <= tau
        assert len(server["staleness"]) == 60 and ps.converged(server)
        assert server["rejected"] == sum(w["rejected"] for w in workers)


def test_async_staleness_exceeds_tau_with_a_slow_worker():
    server = run_world(ps.run_ps, 3, "async", 2, 60, 0.1, 0, worker_delays=[0.002, 0.03])[0]
    # While the slow worker sleeps 30 ms the fast one makes about ten updates; with no delay at
    # all it would finish all 60 before the slow worker pushed once.
    assert max(server["staleness"]) > 2 and server["rejected"] == 0


def test_run_ps_uses_the_rule_it_is_given():
    def only_current(server_version, gradient_version, tau):
        return server_version == gradient_version

    # tau = 50 would admit every gradient here; the rule given admits only fresh ones.
    server = run_world(ps.run_ps, 3, "bounded", 50, 40, 0.1, 0, worker_delays=[0.002, 0.01],
                       rule=only_current)[0]
    assert max(server["staleness"]) == 0 and server["rejected"] > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        ps.run_ps(0, 3, "hogwild", 0, 1, 0.1, 0)
    with pytest.raises(ValueError, match="worker_delays"):
        ps.run_ps(0, 3, "async", 0, 1, 0.1, 0, worker_delays=[0.1])


DATA = ddp.make_regression(2, 48, 10, 3)


def model_fn():
    return ddp.small_mlp(3, 10, 20, 3)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero1_matches_adam_and_holds_a_share_of_the_state(world_size):
    reference = zero.train_adam_reference(model_fn, DATA, 3, 0.01)
    results = run_world(zero.train_zero, world_size, model_fn, DATA, 3, 0.01)
    zero.check_zero(results, reference)
    numel = sum(p.numel() for p in model_fn().parameters())
    # Two fp32 moments of ceil(P / N) elements.
    assert {r["state_bytes"] for r in results} == {2 * 4 * -(-numel // world_size)}


class _FullStateAdam(zero.Zero1Adam):
    def optimizer_state_bytes(self):
        return 2 * 4 * self.numel


def test_the_check_rejects_unsharded_state():
    reference = zero.train_adam_reference(model_fn, DATA, 1, 0.01)
    results = run_world(zero.train_zero, 2, model_fn, DATA, 1, 0.01, optimizer_cls=_FullStateAdam)
    with pytest.raises(checks.MismatchError, match="optimizer state"):
        zero.check_zero(results, reference)


def test_zero1_with_a_large_eps():
    # Adam barely notices gradients scaled by N; with eps near the gradients' size it does.
    reference = zero.train_adam_reference(model_fn, DATA, 3, 0.01, eps=0.1)
    zero.check_zero(run_world(zero.train_zero, 2, model_fn, DATA, 3, 0.01, eps=0.1), reference)


@pytest.mark.parametrize("world_size, d_hidden", [(2, 32), (3, 29), (4, 6)])
def test_tensor_parallel_mlp_equals_the_unsplit_mlp(world_size, d_hidden):
    results = run_world(tensor_parallel.tp_trial, world_size, 1, 7, 10, d_hidden)
    tensor_parallel.check_tp(results, 1, 7, 10, d_hidden)


@pytest.mark.parametrize("world_size", [2, 3])
def test_sequence_parallel_mlp_holds_token_slices_of_the_unsplit_mlp(world_size):
    results = run_world(tensor_parallel.tp_trial, world_size, 2, 6, 10, 17, sequence_parallel=True)
    assert all(r["y"].shape == (6 // world_size, 10) for r in results)
    tensor_parallel.check_tp(results, 2, 6, 10, 17, sequence_parallel=True)


def test_pipeline_bubble():
    assert tensor_parallel.pipeline_bubble_fraction(1, 8) == 0
    assert tensor_parallel.pipeline_bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert tensor_parallel.pipeline_bubble_fraction(4, 12) == pytest.approx(3 / 15)
