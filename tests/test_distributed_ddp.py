"""Lab 07 distributed: naive and bucketed data parallelism reproduce single-process SGD."""

import pytest
import torch
import torch.distributed as dist

from fastdl_lab import checks
from fastdl_lab.distributed import ddp, run_world

pytestmark = pytest.mark.distributed

DATA = ddp.make_regression(0, 48, 12, 3)
STEPS, LR = 5, 0.1


def model_fn():
    return ddp.small_mlp(1, 12, 24, 3)


@pytest.fixture(scope="module")
def reference():
    return ddp.train_reference(model_fn, DATA, STEPS, LR)


def test_reference_training_learns(reference):
    x, y = DATA
    before = torch.nn.functional.mse_loss(model_fn()(x), y)
    model = model_fn()
    model.load_state_dict(reference)
    assert torch.nn.functional.mse_loss(model(x), y) < before


@pytest.mark.parametrize("world_size", [2, 3])
def test_naive_allreduce_matches_single_process(reference, world_size):
    ddp.check_parity(run_world(ddp.train_ddp, world_size, model_fn, DATA, STEPS, LR), reference, "naive")


@pytest.mark.parametrize("bucket_bytes", [1, 1000, 1 << 30])
def test_bucketed_matches_single_process(reference, bucket_bytes):
    states = run_world(ddp.train_ddp, 2, model_fn, DATA, STEPS, LR, sync=ddp.BucketedDDP, bucket_bytes=bucket_bytes)
    ddp.check_parity(states, reference, f"bucketed {bucket_bytes}")


def test_a_gradient_sync_that_forgets_to_average_is_caught(reference):
    def summed(model, world_size):
        for p in model.parameters():
            dist.all_reduce(p.grad)

    with pytest.raises(checks.MismatchError):
        ddp.check_parity(run_world(ddp.train_ddp, 2, model_fn, DATA, STEPS, LR, sync=summed), reference)


@pytest.mark.parametrize("bucket_bytes, buckets", [(1, 6), (300, 3), (1000, 2), (1 << 30, 1)])
def test_one_allreduce_per_bucket_per_step(bucket_bytes, buckets):
    # Parameters in reverse: b3 (12 B) + w3 (288 B), b2 (96 B) + w2 (2304 B), b1 (96 B) + w1 (1152 B).
    assert ddp.expected_num_buckets(model_fn(), bucket_bytes) == buckets
    for stats in run_world(ddp.bucket_stats, 2, model_fn, DATA, bucket_bytes, steps=3):
        assert stats == {"allreduce_calls": 3 * buckets, "num_buckets": buckets, "steps": 3,
                         "launched_in_backward": buckets}


def _launch_times(rank, world_size, bucket_bytes):
    """Whether each all-reduce was started while backward was still running."""
    x, y = ddp._shard(DATA, rank, world_size)
    model = model_fn()
    wrapper = ddp.BucketedDDP(model, bucket_bytes)
    in_backward, seen = [True], []
    real = dist.all_reduce

    def spy(*args, **kwargs):
        seen.append(in_backward[0])
        return real(*args, **kwargs)

    dist.all_reduce = spy
    ddp._loss(model, x, y).backward()
    in_backward[0] = False
    wrapper.finish()
    return seen


def test_buckets_launch_during_backward_in_reverse_order():
    seen = run_world(_launch_times, 2, 300)[0]
    # Every bucket's gradients are complete before backward returns, so all three launch inside it.
    assert seen == [True, True, True]


def _bucket_contents(rank, world_size, bucket_bytes):
    wrapper = ddp.BucketedDDP(model_fn(), bucket_bytes)
    names = {p: n for n, p in wrapper.module.named_parameters()}
    return [[names[p] for p in bucket] for bucket in wrapper._buckets]


def test_first_bucket_holds_the_last_layer():
    buckets = run_world(_bucket_contents, 2, 300)[0]
    assert buckets == [["4.bias", "4.weight"], ["2.bias", "2.weight"], ["0.bias", "0.weight"]]


def test_uneven_shards_are_refused():
    with pytest.raises(ValueError, match="do not split evenly"):
        ddp._shard(DATA, 0, 5)
