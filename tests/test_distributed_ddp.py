"""Lab 07 distributed: DDP wrappers behave like torch's DistributedDataParallel and reproduce
single-process SGD from ranks that start apart; the trusted log sees every all-reduce."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastdl_lab import checks
from fastdl_lab.distributed import ddp, run_world, watch

pytestmark = pytest.mark.distributed

DATA = ddp.make_regression(0, 48, 12, 3)
STEPS, LR = 3, 0.1
model_fn = functools.partial(ddp.rank_skewed_mlp, 1, 12, 24, 3)
model_fn0 = functools.partial(ddp.rank_skewed_mlp, 1, 12, 24, 3, rank=0)
# Launch order of the parameters' sizes: b3 (3), w3 (72), b2 (24), w2 (576), b1 (24), w1 (288).
PARAM_NUMELS = [p.numel() for p in model_fn0().parameters()]


@pytest.fixture(scope="module")
def reference():
    return ddp.train_reference(model_fn0, DATA, STEPS, LR)


def test_reference_training_learns(reference):
    x, y = DATA
    before = torch.nn.functional.mse_loss(model_fn0()(x), y)
    model = model_fn0()
    model.load_state_dict(reference)
    assert torch.nn.functional.mse_loss(model(x), y) < before


def test_ranks_start_apart_and_rank_zero_draws_the_reference_model():
    starts = run_world(lambda rank, world_size: ddp._detached_state(model_fn()), 2)
    assert all(torch.equal(starts[0][k], v) for k, v in model_fn0().state_dict().items())
    assert not torch.equal(starts[0]["0.shift"], starts[1]["0.shift"])
    assert not torch.equal(starts[0]["1.weight"], starts[1]["1.weight"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_naive_allreduce_matches_single_process(reference, world_size):
    ddp.check_parity(run_world(ddp.train_ddp, world_size, model_fn, DATA, STEPS, LR), reference, "naive")


def _looks(rank, world_size):
    """state_dict keys, parameter names and outputs of our wrappers and of torch's own DDP."""
    x = DATA[0][:4]
    looks = {}
    for name, wrap in (("torch", nn.parallel.DistributedDataParallel), ("DDP", ddp.DDP),
                       ("BucketedDDP", functools.partial(ddp.BucketedDDP, bucket_bytes=100))):
        model = model_fn()
        wrapper = wrap(model)
        assert [id(p) for p in wrapper.parameters()] == [id(p) for p in model.parameters()]
        looks[name] = (list(wrapper.state_dict()), [n for n, _ in wrapper.named_parameters()],
                       wrapper(x).detach(), ddp._detached_state(model))
    return looks


def test_wrappers_look_like_torch_ddp_and_broadcast_parameters_and_buffers():
    per_rank = run_world(_looks, 2)
    start = model_fn0().state_dict()
    for looks in per_rank:
        keys, names, out, _ = looks["torch"]
        assert keys[0] == "module.0.shift" and names[0] == "module.1.weight"
        for name in ("DDP", "BucketedDDP"):
            assert looks[name][:2] == (keys, names), name
            assert torch.equal(looks[name][2], out), name
            # Every rank now holds rank 0's weights and buffer, as after torch's DDP.
            assert all(torch.equal(looks[name][3][k], v) for k, v in start.items()), name


@pytest.mark.parametrize("sync, kwargs, expected, ordered", [
    (ddp.DDP, {}, PARAM_NUMELS, False),
    (ddp.BucketedDDP, {"bucket_bytes": 1}, PARAM_NUMELS[::-1], True),
    (ddp.BucketedDDP, {"bucket_bytes": 300}, [75, 600, 312], True),
    (ddp.BucketedDDP, {"bucket_bytes": 1 << 30}, [987], True),
])
def test_wrappers_match_single_process_from_skewed_starts(reference, sync, kwargs, expected, ordered):
    trials = run_world(watch.ddp_trial, 2, model_fn, DATA, STEPS, LR, sync=sync, **kwargs)
    watch.check_trials(trials, model_fn0, reference, sync.__name__)
    assert watch.overlap_problem(trials, expected, STEPS, ordered) is None
    if sync is ddp.BucketedDDP:
        assert ddp.bucket_sizes(model_fn0(), kwargs["bucket_bytes"]) == expected


class NoBroadcast(nn.Module):
    """A wrapper that forgets step 1 (or, with ``parameters_only``, the buffers), and all-reduces
    only after backward."""

    def __init__(self, module, parameters_only=False):
        super().__init__()
        self.module = module
        if parameters_only:
            with torch.no_grad():
                for p in module.parameters():
                    dist.broadcast(p, src=0)

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        ddp.allreduce_gradients_ref(self.module, dist.get_world_size())


@pytest.mark.parametrize("parameters_only, named", [(False, "parameter 1.weight"), (True, "buffer 0.shift")])
def test_a_wrapper_that_skips_the_broadcast_is_named(reference, parameters_only, named):
    trials = run_world(watch.ddp_trial, 2, model_fn, DATA, STEPS, LR, sync=NoBroadcast,
                       parameters_only=parameters_only)
    with pytest.raises(checks.MismatchError, match=f"rank 1 does not start from rank 0's {named}"):
        watch.check_trials(trials, model_fn0, reference)
    kind, why = watch.overlap_problem(trials, PARAM_NUMELS, STEPS, ordered=False)
    assert kind == "late" and "outside backward" in why


class OverlapInAnotherBackward(NoBroadcast):
    """Pretends to overlap: every all-reduce runs inside a throwaway backward after the real one."""

    def __init__(self, module):
        super().__init__(module)
        ddp.broadcast_state(module)

    def finish_gradient_synchronization(self):
        x = torch.ones(1, requires_grad=True)
        y = (x * 2).sum()
        y.register_hook(lambda grad: super(OverlapInAnotherBackward, self).finish_gradient_synchronization())
        y.backward()


def test_the_log_counts_only_the_training_loops_own_backward(reference):
    trials = run_world(watch.ddp_trial, 2, model_fn, DATA, 2, LR, sync=OverlapInAnotherBackward)
    watch.check_trials(trials, model_fn0, ddp.train_reference(model_fn0, DATA, 2, LR))
    assert {c["phase"] for c in trials[0]["allreduces"]} == {"finish"}
    assert watch.overlap_problem(trials, PARAM_NUMELS, 2, ordered=False)[0] == "late"


def test_a_gradient_sync_that_forgets_to_average_is_caught(reference):
    def summed(model, world_size):
        for p in model.parameters():
            dist.all_reduce(p.grad)

    with pytest.raises(checks.MismatchError):
        ddp.check_parity(run_world(ddp.train_ddp, 2, model_fn, DATA, STEPS, LR, sync=summed), reference)


def test_what_is_not_a_ddp_wrapper_is_refused_by_name():
    class Plain:
        def __init__(self, module):
            self.module = module

    class NoFinish(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    with pytest.raises(TypeError, match="must subclass torch.nn.Module"):
        ddp._data_parallel(model_fn0(), Plain, 1, {})
    with pytest.raises(TypeError, match="no finish_gradient_synchronization"):
        ddp._data_parallel(model_fn0(), NoFinish, 1, {})
    with pytest.raises(TypeError, match="sync function takes"):
        ddp._data_parallel(model_fn0(), ddp.allreduce_gradients_ref, 1, {"bucket_bytes": 8})


def _bucket_contents(rank, world_size, bucket_bytes):
    wrapper = ddp.BucketedDDP(model_fn(), bucket_bytes)
    names = {p: n for n, p in wrapper.module.named_parameters()}
    return [[names[p] for p in bucket] for bucket in wrapper._buckets], wrapper.num_buckets


def test_first_bucket_holds_the_last_layer():
    buckets, count = run_world(_bucket_contents, 2, 300)[0]
    assert buckets == [["5.bias", "5.weight"], ["3.bias", "3.weight"], ["1.bias", "1.weight"]] and count == 3


def test_bad_arguments():
    with pytest.raises(ValueError, match="do not split evenly"):
        ddp._shard(DATA, 0, 5)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        ddp.BucketedDDP(model_fn0(), 0)
