"""The relay that carries a graded world's collectives (autograder/engine/relay.py) and the backend
a rank joins it with (relay_backend.py): every operation gives what gloo gives, blocking and
async; the log counts what each rank handed over (a ring's bytes, DDP's buckets, FSDP's gathers);
a world whose ranks disagree, die, stall or send what the relay refuses ends on every rank, with
the reason, within the timeout. Ranks are honest processes here (tests/relay_ranks.py)."""

import re

import pytest
import torch

from autograder.engine.relay import bytes_sent
from fastdl_lab.distributed import ddp, fsdp, ring, run_world, tensor_parallel
from relay_ranks import PROGRAMS, run, warm

pytestmark = pytest.mark.distributed

TIMEOUT_S = 1.5
# Failures that must come at once are tested under a long timeout and must come well before it,
# with room for a loaded machine.
PATIENT_S, AT_ONCE_S = 10.0, 4.0


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    warm()


def _ok(outcome) -> None:
    assert not outcome.errors, outcome.errors
    assert outcome.failure is None, outcome.failure
    for record in outcome.records:
        assert record["completed_s"] is not None and record["error"] is None, record
        assert record["completed_s"] >= max(record["arrived_s"].values())


def _collectives(records, op=None) -> list[dict]:
    return [r for r in records if r["kind"] == "collective" and op in (None, r["op"])]


@pytest.mark.parametrize("world", [2, 3])
def test_every_operation_gives_what_gloo_gives_blocking_and_async(world):
    gloo = run_world(PROGRAMS["every_op"], world, False, False)
    for use_async in (False, True):
        outcome = run("every_op", world, use_async)
        _ok(outcome)
        for rank, (got, want) in enumerate(zip(outcome.results, gloo)):
            for key, expected in want.items():
                torch.testing.assert_close(got[key], expected, rtol=0, atol=0, msg=f"rank {rank} {key}")
            torch.testing.assert_close(got["all_reduce_avg"], want["all_reduce_sum"] / world, rtol=0, atol=0)


def test_the_log_holds_every_operation_in_order_with_its_bytes():
    world = 3
    outcome = run("every_op", world, True)
    _ok(outcome)
    collectives = _collectives(outcome.records)
    assert [r["seq"] for r in collectives] == list(range(len(collectives)))
    assert [r["op"] for r in collectives] == ["all_reduce"] * 9 + [
        "reduce", "broadcast", "all_gather", "all_gather_single", "reduce_scatter", "reduce_scatter_single", "gather",
        "scatter", "barrier"]
    by_op = {r["op"]: r for r in collectives}
    assert [r["reduce"] for r in collectives[:5]] == ["sum", "product", "min", "max", "avg"]
    everyone = {r: 60 for r in range(world)}  # 3 x 5 float32
    assert collectives[0]["sent_bytes"] == collectives[0]["received_bytes"] == everyone
    assert (collectives[0]["dtype"], collectives[0]["shape"], collectives[0]["numel"]) == ("float32", [3, 5], 15)
    broadcast = by_op["broadcast"]
    assert broadcast["src"] == world - 1 and broadcast["dtype"] == "float64"
    assert broadcast["sent_bytes"] == {0: 0, 1: 0, 2: 48} and broadcast["received_bytes"] == {0: 48, 1: 48, 2: 0}
    assert by_op["all_gather"]["sent_bytes"] == {r: 20 for r in range(world)}
    assert by_op["all_gather"]["received_bytes"] == {r: 20 * world for r in range(world)}
    assert by_op["reduce_scatter_single"]["sent_bytes"] == {r: 16 * world for r in range(world)}
    assert by_op["reduce_scatter_single"]["received_bytes"] == {r: 16 for r in range(world)}
    assert by_op["gather"]["dst"] == 0 and by_op["gather"]["received_bytes"] == {0: 16 * world, 1: 0, 2: 0}
    assert by_op["barrier"]["sent_bytes"] == {r: 0 for r in range(world)}
    sends = [r for r in outcome.records if r["kind"] == "p2p"]
    assert len(sends) == 2 * world + world - 1
    tagged = sorted((r["src"], r["dst"], r["tag"], r["numel"]) for r in sends if r["dst"] == (r["src"] + 1) % world
                    and r["tag"])
    assert tagged == sorted((s, (s + 1) % world, tag, 4 - tag) for s in range(world) for tag in (1, 2))
    for rank in range(world):
        assert bytes_sent(outcome.records, rank) == 4 * (2 + 3) + (4 if rank else 0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_ring_all_reduce_hands_the_relay_two_n_minus_one_over_n_of_the_tensor(world):
    numels = [1, 7, 12 * world, 1001]
    outcome = run("ring", world, numels)
    _ok(outcome)
    assert {r["op"] for r in _collectives(outcome.records)} == {"barrier"}
    barriers = _collectives(outcome.records)
    for rank in range(world):
        edges = [0.0] + [b["arrived_s"][rank] for b in barriers]
        for i, numel in enumerate(numels):
            sends = [r for r in outcome.records if r["op"] == "send" and r["src"] == rank
                     and edges[i] < r["arrived_s"][rank] < edges[i + 1]]
            assert all(r["dst"] == (rank + 1) % world for r in sends)
            sent = sum(r["sent_bytes"][rank] for r in sends)
            assert sent == ring.ring_bytes_ref(numel, 4, world, rank), (rank, numel, sent)
            if numel % world == 0:
                assert sum(r["numel"] for r in sends) == 2 * (world - 1) * numel // world
            result = outcome.results[rank][i]
            expected = sum(ring.trial_input(r, numel, seed=numel) for r in range(world))
            torch.testing.assert_close(result["out"], expected, rtol=0, atol=0)
            assert result["reported"] == sent


def test_async_work_is_sent_when_called_and_done_without_waiting():
    outcome = run("overlaps", 3)
    _ok(outcome)
    rank0 = outcome.results[0]
    (record,) = _collectives(outcome.records)
    assert rank0["issued"] <= record["arrived_s"][0] < rank0["waited"] - 0.3
    assert record["completed_s"] < rank0["waited"] and rank0["done_before_wait"]
    assert rank0["sum"].tolist() == [3.0] * 4
    # Marks: where rank 0 said it was, on the relay's clock.
    marks = [r for r in outcome.records if r["kind"] == "mark"]
    assert [(m["label"], m["seq"], m["src"]) for m in marks] == [("computing", 0, 0), ("waiting", 1, 0)]
    assert record["arrived_s"][0] <= marks[0]["arrived_s"][0] and marks[1]["arrived_s"][0] >= rank0["waited"]


def test_torch_ddp_and_the_course_bucketed_ddp_train_over_the_relay():
    world, steps, bucket_bytes = 2, 3, 200
    outcome = run("ddp_training", world, steps, bucket_bytes)
    _ok(outcome)
    reference = ddp.train_reference(lambda: ddp.rank_skewed_mlp(3, 6, 10, 2, rank=0),
                                    ddp.make_regression(5, 4 * world, 6, 2), steps, 0.1)
    for result in outcome.results:
        ddp.check_parity([result["torch"]], reference, "torch DDP")
        ddp.check_parity([result["course"]], reference, "BucketedDDP")
    collectives = _collectives(outcome.records)
    marker = next(i for i, r in enumerate(collectives) if r["op"] == "barrier")
    model = ddp.rank_skewed_mlp(3, 6, 10, 2, rank=0)
    n_params = sum(p.numel() for p in model.parameters())
    torch_reduces = _collectives(collectives[:marker], "all_reduce")
    assert sum(r["numel"] for r in torch_reduces) == steps * n_params
    course = collectives[marker + 1:]
    assert [r["op"] for r in course if r["op"] != "all_reduce"] == ["broadcast"] * len(model.state_dict())
    sizes = [r["numel"] for r in course if r["op"] == "all_reduce"]
    assert sizes == ddp.bucket_sizes(model, bucket_bytes) * steps
    assert all(r["sent_bytes"] == {0: 4 * r["numel"], 1: 4 * r["numel"]} for r in course if r["op"] == "all_reduce")


def test_fsdp_and_tensor_parallel_collectives_are_counted_by_the_relay():
    world, dims, steps = 2, [7, 12, 9, 3], 2
    outcome = run("sharding", world)
    _ok(outcome)
    reference = fsdp.train_reference(lambda: fsdp.unit_mlp(2, dims), ddp.make_regression(2, 3 * world, 7, 3), steps,
                                     0.1)
    fsdp.check_parity([r["fsdp"] for r in outcome.results], reference)
    tensor_parallel.check_tp([r["tp"] for r in outcome.results], 4, 5, 6, 4 * world + 1)
    collectives = _collectives(outcome.records)
    marker = next(i for i, r in enumerate(collectives) if r["op"] == "barrier")
    units = len(dims) - 1
    fsdp_ops = [r["op"] for r in collectives[:marker]]
    assert fsdp_ops.count("all_gather_single") == 2 * units * steps
    assert fsdp_ops.count("reduce_scatter_single") == units * steps
    assert set(fsdp_ops) == {"all_gather_single", "reduce_scatter_single"}
    gathered = sum(r["received_bytes"][0] for r in collectives[:marker] if r["op"] == "all_gather_single")
    padded = sum(world * shard for _, shard in fsdp.unit_sizes(reference, world))
    assert gathered == 2 * steps * 4 * padded
    assert [r["op"] for r in collectives[marker + 1:]] == ["all_reduce", "all_reduce"]  # one forward, one backward


def test_torch_fsdp2_trains_over_the_relay_with_gathers_and_reduce_scatters_only():
    import torch.nn.functional as F

    from relay_ranks import fsdp2_data, fsdp2_model

    world, steps = 2, 2
    outcome = run("fsdp2", world, steps)
    _ok(outcome)
    model = fsdp2_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = fsdp2_data(world)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    for rank, weights in enumerate(outcome.results):
        for name, p in model.named_parameters():
            torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    collectives = _collectives(outcome.records)
    training = [r["op"] for r in collectives[:next(i for i, r in enumerate(collectives) if r["op"] == "barrier")]]
    assert set(training) == {"all_gather_single", "reduce_scatter_single"}
    assert training.count("reduce_scatter_single") == 2 * steps  # one per layer and step
    assert training.count("all_gather_single") >= 2 * steps


# --- worlds that fail ------------------------------------------------------------------------


def _failed_record(outcome) -> dict:
    return next(r for r in outcome.records if r["error"] is not None)


def _all_failed(outcome, pattern: str, within_s: float) -> None:
    """Every rank ended with the relay's error, which says ``pattern``, within ``within_s`` of
    the last arrival at the collective that failed (the relay's clock and the ranks' are one)."""
    assert outcome.failure is not None and re.search(pattern, outcome.failure), outcome.failure
    assert set(outcome.errors) == set(range(len(outcome.results))), outcome.errors
    last_arrival = max(_failed_record(outcome)["arrived_s"].values())
    for rank, error in outcome.errors.items():
        assert re.search(pattern, error) or "disconnected" in error, (rank, error)
        assert outcome.finished[rank] - last_arrival < within_s, (rank, outcome.finished[rank] - last_arrival)


@pytest.mark.parametrize("kind, pattern", [
    ("shape", r"collective #1 does not match across ranks: rank \d called all_reduce\(sum, float32\[\d\]\), rank \d "
              r"called all_reduce\(sum, float32\[\d\]\)"),
    ("op", r"collective #1 does not match.*(broadcast\(root 0, float32\[4\]\).*all_reduce\(sum, float32\[4\]\)|"
           r"all_reduce\(sum, float32\[4\]\).*broadcast\(root 0, float32\[4\]\))"),
    ("dtype", r"collective #1 does not match.*float64\[4\]"),
    ("reduce", r"collective #1 does not match.*all_reduce\(max, float32\[4\]\)"),
    ("root", r"collective #1 does not match.*broadcast\(root \d"),
])
def test_a_collective_that_does_not_match_fails_every_rank_at_once(kind, pattern):
    outcome = run("mismatched", 2, kind, timeout_s=PATIENT_S)
    _all_failed(outcome, pattern, within_s=AT_ONCE_S)
    failed = [r for r in outcome.records if r["error"]]
    assert failed and failed[0]["seq"] == 1


@pytest.mark.parametrize("how, pattern", [
    ("before", r"rank 1 disconnected .* while ranks \[0(, 2)?\] waited for it in collective #1, all_reduce"),
    ("in_flight", r"rank 1 disconnected .* with its all_reduce unanswered"),
])
def test_a_rank_that_dies_fails_the_world_without_waiting_for_the_timeout(how, pattern):
    outcome = run("dies", 3, how, timeout_s=PATIENT_S)
    assert outcome.exit_codes[1] == 3
    assert outcome.failure is not None and re.search(pattern, outcome.failure), outcome.failure
    assert 1 not in outcome.results or outcome.results[1] is None
    began = min(_failed_record(outcome)["arrived_s"].values())
    for rank in (0, 2):
        assert "relay: " in outcome.errors[rank] and "rank 1 disconnected" in outcome.errors[rank]
        assert outcome.finished[rank] - began < AT_ONCE_S


@pytest.mark.parametrize("what, pattern", [
    ("collective", r"collective #0, all_reduce\(sum, float32\[2\]\), timed out after 1.5 s: ranks \[0\] arrived, "
                   r"ranks \[1\] did not"),
    ("recv", r"rank 0's recv of float32\[2\] from rank 1 \(tag 0\) timed out after 1.5 s: no matching send"),
])
def test_a_wait_past_the_timeout_fails_every_rank(what, pattern):
    outcome = run("stalls", 2, what, TIMEOUT_S + 1.0, timeout_s=TIMEOUT_S)
    assert not outcome.errors, outcome.errors
    assert outcome.failure is not None and re.search(pattern, outcome.failure), outcome.failure
    waited, late = outcome.results
    assert re.search(pattern, waited["error"]) and re.search(pattern, late["error"])
    assert TIMEOUT_S - 0.05 < waited["ended"] - waited["began"] < TIMEOUT_S + 1.5
    assert late["ended"] - late["began"] < 1.0  # a failed world answers at once


def test_a_rank_that_never_connects_fails_the_others_at_the_timeout():
    outcome = run("every_op", 3, False, ranks=[0, 2], timeout_s=TIMEOUT_S)
    assert outcome.failure == "ranks [1] did not connect within 1.5 s of the first"
    for rank in (0, 2):
        assert outcome.errors[rank] == f"RuntimeError: relay: {outcome.failure}"
        assert TIMEOUT_S <= outcome.finished[rank] - outcome.started < TIMEOUT_S + 5.0


def test_a_message_over_the_cap_is_refused_by_the_rank_before_it_leaves():
    outcome = run("too_large", 2, max_message_bytes=8192, timeout_s=TIMEOUT_S)
    assert outcome.errors[0].startswith("ValueError: a message of ") and "at most 8192" in outcome.errors[0]
    # Rank 1 arrives before rank 0 has gone, or after.
    gone = r"rank 0 disconnected|needs ranks \[0\], which have left the world"
    assert re.search(gone, outcome.failure) and re.search(gone, outcome.errors[1])
    assert not outcome.records or outcome.records[0]["sent_bytes"] == {1: 16}


@pytest.mark.parametrize("kind, pattern", [
    ("huge", r"rank 1 sent a message of 1073741824 bytes, more than the 1048576 a message may hold"),
    ("garbage", r"rank 1 sent a message that is not data: not the grader's data format"),
    ("unknown", r"rank 1: asked for 'exec', which the relay does not carry"),
])
def test_what_the_relay_refuses_from_a_rank_fails_the_world(kind, pattern):
    outcome = run("hostile_frame", 2, kind, timeout_s=PATIENT_S)
    assert outcome.failure is not None and re.search(pattern, outcome.failure), outcome.failure
    assert re.search(pattern, outcome.errors[0]), outcome.errors
    assert outcome.finished[0] - outcome.started < AT_ONCE_S


def test_handed_over_bytes_not_yet_delivered_are_capped():
    outcome = run("floods", 2, 50, 1000, max_held_bytes=20_000, timeout_s=TIMEOUT_S)
    assert outcome.failure == ("rank 0: the ranks have handed the relay 24000 bytes not yet delivered; at most 20000 "
                               "may be in flight")
    assert outcome.errors[0] == outcome.errors[1] == f"RuntimeError: relay: {outcome.failure}"
    sends = [r for r in outcome.records if r["op"] == "send"]
    assert len(sends) == 6 and all(r["completed_s"] is None and r["error"] == outcome.failure for r in sends)


def test_operations_are_capped_empty_or_not():
    outcome = run("floods", 2, 500, 0, max_operations=40, timeout_s=TIMEOUT_S)
    assert outcome.failure == "rank 0: more than 40 operations in one world"
    assert set(outcome.errors) == {0, 1} and len(outcome.records) == 40


def test_a_rank_is_the_socket_it_speaks_on_whatever_it_says():
    outcome = run("impostor", 2, timeout_s=TIMEOUT_S)
    _ok(outcome)
    receiver, impostor = outcome.results
    assert impostor["refused"]  # one connection per socket
    assert impostor["answer"] == {"id": 0, "tensors": []}
    assert receiver["src"] == 1 and receiver["value"].tolist() == [1.0, 2.0]
    (send,) = outcome.records
    assert (send["src"], send["dst"], send["sent_bytes"], send["received_bytes"]) == (1, 0, {1: 8}, {0: 8})
