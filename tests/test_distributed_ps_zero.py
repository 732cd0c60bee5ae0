"""Lab 07 distributed: parameter server (sync, async, bounded staleness, SSP), ZeRO-1, tensor parallel."""

import math

import pytest
import torch
import torch.distributed as dist

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


def test_ssp_start_rule():
    rule = ps.ssp_may_start_ref
    assert rule([0, 0, 0], 1, 0) and not rule([1, 0, 0], 0, 0)
    assert rule([3, 1], 0, 2) and not rule([4, 1], 0, 2)
    assert rule([4, 1], 1, 0)  # the slowest may always start: no starvation


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_ssp_keeps_workers_within_tau_iterations_and_discards_nothing(tau):
    steps = 60
    server, *workers = run_world(ps.run_ps, 3, "ssp", tau, steps, 0.1, 0, worker_delays=[0.002, 0.04])
    assert max(server["clock_gaps"]) <= tau and server["rejected"] == 0 and not server["deadlocked"]
    assert len(server["staleness"]) == steps and len(server["losses"]) == steps and ps.converged(server)
    if tau <= 1:  # twenty times faster, the fast worker is soon that far ahead, however busy the machine
        assert server["holds"] > 0, "the fast worker never waited for the slow one"
    assert sum(w["rejected"] for w in workers) == 0
    # The bound is on iterations, not on versions: each worker's gradients apply one at a time.
    assert max(server["staleness"]) <= (tau + 1) * 2


def test_async_lets_a_fast_worker_run_ahead_of_any_ssp_bound():
    server = run_world(ps.run_ps, 3, "async", 1, 60, 0.1, 0, worker_delays=[0.002, 0.04])[0]
    assert max(server["clock_gaps"]) > 1 and server["holds"] == 0


def test_ssp_uses_the_start_rule_it_is_given():
    def one_ahead(clocks, worker, tau):  # off by one: lets a worker run tau + 1 ahead
        return clocks[worker] - min(clocks) <= tau + 1

    server = run_world(ps.run_ps, 3, "ssp", 1, 60, 0.1, 0, worker_delays=[0.002, 0.04], start_rule=one_ahead)[0]
    assert max(server["clock_gaps"]) == 2

    # A rule that holds everyone would leave every worker waiting for ever: the server stops the run.
    server = run_world(ps.run_ps, 3, "ssp", 1, 60, 0.1, 0, start_rule=lambda clocks, worker, tau: False)[0]
    assert server["deadlocked"] and len(server["staleness"]) < 60


def test_a_synchronous_start_then_asynchrony():
    sync_steps = 10
    server = run_world(ps.run_ps, 3, "async", 0, 50, 0.1, 0, worker_delays=[0.002, 0.02], sync_steps=sync_steps)[0]
    assert server["updates_by"][:sync_steps] == [0] * sync_steps
    assert set(server["updates_by"][sync_steps:]) <= {1, 2} and server["updates_by"][sync_steps:]
    # One gradient per worker in each sync round, all on the current weights.
    assert server["staleness"][:2 * sync_steps] == [0] * (2 * sync_steps)
    assert max(server["staleness"][2 * sync_steps:]) > 0 and len(server["losses"]) == 50


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        ps.run_ps(0, 3, "hogwild", 0, 1, 0.1, 0)
    with pytest.raises(ValueError, match="worker_delays"):
        ps.run_ps(0, 3, "async", 0, 1, 0.1, 0, worker_delays=[0.1])
    with pytest.raises(ValueError, match="tau"):
        ps.run_ps(0, 3, "ssp", -1, 1, 0.1, 0)
    with pytest.raises(ValueError, match="sync_steps"):
        ps.run_ps(0, 3, "async", 0, 5, 0.1, 0, sync_steps=6)


DATA = ddp.make_regression(2, 48, 10, 3)
RUNS = [("AdamW", {"lr": 0.02, "weight_decay": 0.1, "betas": (0.8, 0.99)}),
        ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01})]


def model_fn():
    return ddp.small_mlp(3, 10, 20, 3)


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero1_is_bit_identical_to_the_unsharded_optimizer(world_size):
    per_rank = run_world(zero.zero_trial, world_size, model_fn, DATA, 3, RUNS)
    numels = [p.numel() for p in model_fn().parameters()]
    owners = zero.owners_ref(numels, world_size)
    for j, (name, defaults) in enumerate(RUNS):
        results = [r[j] for r in per_rank]
        zero.check_zero(results, model_fn, name, defaults, 3)
        # torch.equal, not a tolerance: the very optimizer class ran on every parameter.
        reference = zero.replay_reference(model_fn, results[0]["grads"], zero.optimizer_class(name), defaults)
        assert all(torch.equal(r["state"][k], v) for r in results for k, v in reference["state"].items())
        for rank, result in enumerate(results):
            mine = [i for i, owner in enumerate(owners) if owner == rank]
            assert result["owned"] == mine
            assert result["state_bytes"] == sum(reference["state_bytes"][i] for i in mine)


def test_owners_balance_largest_first():
    assert zero.owners_ref([10, 1, 10, 1, 5], 2) == [0, 1, 1, 1, 0]
    assert zero.owners_ref([3], 3) == [0]


class _Unsharded(zero.Zero1):
    """The cheap way out: the whole optimizer on every rank."""

    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.optimizer = optimizer_class(self.params, **defaults)

    def step(self):
        self.optimizer.step()


class _HandWrittenAdamW(zero.Zero1):
    """Sharded, but AdamW written out with mul_().add_() for the first moment where torch uses lerp_."""

    def __init__(self, params, optimizer_class, **defaults):
        super().__init__(params, optimizer_class, **defaults)
        self.lr, self.wd = defaults["lr"], defaults["weight_decay"]
        self.moments, self.t = {}, 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p, owner in zip(self.params, self.owners):
            if owner == dist.get_rank():
                m, v = self.moments.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
                p.mul_(1 - self.lr * self.wd)
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.999).addcmul_(p.grad, p.grad, value=0.001)
                denom = (v.sqrt() / math.sqrt(1 - 0.999 ** self.t)).add_(1e-8)
                p.addcdiv_(m, denom, value=-self.lr / (1 - 0.9 ** self.t))
            dist.broadcast(p, src=owner)


@pytest.mark.parametrize("cls, match", [(_Unsharded, "on ranks \\[0, 1\\]"),
                                        (_HandWrittenAdamW, "bit-identical expected")])
def test_the_check_rejects_full_state_and_a_hand_written_update(cls, match):
    defaults = {"lr": 0.01, "weight_decay": 0.1}
    results = [r[0] for r in run_world(zero.zero_trial, 2, model_fn, DATA, 3, [("AdamW", defaults)], zero_cls=cls)]
    with pytest.raises(checks.MismatchError, match=match):
        zero.check_zero(results, model_fn, "AdamW", defaults, 3)


def test_a_zero1_that_forgets_the_broadcast_is_named():
    class NoBroadcast(zero.Zero1):
        def step(self):
            self.optimizer.step()

    defaults = {"lr": 0.05, "momentum": 0.9}
    results = [r[0] for r in run_world(zero.zero_trial, 2, model_fn, DATA, 2, [("SGD", defaults)],
                                       zero_cls=NoBroadcast)]
    with pytest.raises(checks.MismatchError, match="never changed in 2 steps: its owner's update must be broadcast"):
        zero.check_zero(results, model_fn, "SGD", defaults, 2)


def test_zero1_refuses_what_it_cannot_shard():
    with pytest.raises(ValueError, match="not one of"):
        zero.optimizer_class("LBFGS")
    with pytest.raises(TypeError, match="parameter groups"):
        zero.Zero1([{"params": []}], torch.optim.SGD, lr=0.1)


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
