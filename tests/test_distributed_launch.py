"""Lab 07 distributed: run_world returns every rank's result and never leaves a rank behind."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fastdl_lab.distributed import launch
from fastdl_lab.distributed.launch import RankFailure, run_world

pytestmark = pytest.mark.distributed


def _children() -> list[int]:
    """This process's live children, from each process's parent id: a thread of ours may exit
    while it is read, so the per-thread children lists are no place to look."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited between the listing and the read
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture(autouse=True)
def no_rank_left_behind():
    before = set(_children())
    yield
    assert set(_children()) - before == set(), "a rank outlived run_world"


def _sum_ranks(rank, world_size, scale, *, offset=0.0):
    t = torch.tensor([rank * scale + offset], requires_grad=True) * 1.0
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "t": t, "name": dist.get_backend()}


def test_results_come_back_per_rank_on_the_cpu_and_detached():
    results = run_world(_sum_ranks, 3, 2.0, offset=1.0)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["name"] == "gloo" for r in results)
    for r in results:
        assert r["t"].device.type == "cpu" and not r["t"].requires_grad
        assert r["t"].item() == pytest.approx(2.0 * (0 + 1 + 2) + 3.0)


def test_one_rank_world_runs():
    assert run_world(_sum_ranks, 1, 5.0)[0]["t"].item() == 0.0


def _raise_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def test_a_rank_that_raises_is_named_with_its_exception():
    with pytest.raises(RankFailure) as info:
        run_world(_raise_on_rank_1, 2)
    assert info.value.rank == 1
    assert info.value.reason == "ValueError: boom on purpose"
    assert "_raise_on_rank_1" in str(info.value)  # the traceback points at the student's line


def _hang_out_of_collective(rank, world_size):
    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_rank_that_never_joins_the_collective_times_out():
    with pytest.raises(RankFailure) as info:
        run_world(_hang_out_of_collective, 2, timeout_s=1.5)
    assert info.value.rank == 0
    assert "timed out" in info.value.reason.lower()
    assert "rank 1 was still running" in str(info.value)


def _both_receive_first(rank, world_size):
    dist.recv(torch.empty(1), src=1 - rank)


def test_a_send_recv_deadlock_times_out():
    with pytest.raises(RankFailure) as info:
        run_world(_both_receive_first, 2, timeout_s=1.0)
    assert "timed out" in info.value.reason.lower()


def _sleep_forever(rank, world_size):
    time.sleep(600)


def test_silence_without_any_collective_hits_the_deadline(monkeypatch):
    monkeypatch.setattr(launch, "STARTUP_S", 1.0)
    with pytest.raises(RankFailure) as info:
        run_world(_sleep_forever, 2, timeout_s=0.5)
    assert info.value.rank == 0
    assert info.value.reason == "no result within 2 s: deadlocked?"


def _die_by_signal(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal():
    with pytest.raises(RankFailure) as info:
        run_world(_die_by_signal, 2, timeout_s=5)
    assert info.value.rank == 1 and info.value.reason == "killed by signal SIGKILL"


def _exit_quietly(rank, world_size):
    if rank == 0:
        os._exit(3)
    dist.barrier()


def test_a_rank_that_exits_without_a_result():
    with pytest.raises(RankFailure) as info:
        run_world(_exit_quietly, 2, timeout_s=5)
    assert info.value.rank == 0 and info.value.reason == "exited with code 3 without returning a result"


def test_an_unpicklable_result_is_a_failure_not_a_hang():
    with pytest.raises(RankFailure) as info:
        run_world(lambda rank, world_size: threading.Lock(), 2)
    assert "pickle" in info.value.reason.lower()


def test_functions_defined_at_run_time_work():
    # What a notebook cell does: no importable name, so only fork can run it.
    scale = 7
    results = run_world(lambda rank, world_size: rank * scale, 2)
    assert results == [0, 7]


def _chatty(rank, world_size):
    print(f"hello from {rank}", end="")
    print(" and a newline")
    return rank


def test_rank_output_is_shown_with_its_rank(capsys):
    run_world(_chatty, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0 and a newline" in out
    assert "[rank 1] hello from 1 and a newline" in out


def _started_at(rank, world_size):
    return time.time()


def test_no_rank_goes_on_before_every_rank_has_joined(monkeypatch):
    # A rank that needs no peer could otherwise finish, and close its end of gloo's mesh and the
    # store, while a slower rank was still in init_process_group ("Connection closed by peer").
    real = dist.init_process_group

    def slow_end_for_rank_1(*args, rank, **kwargs):
        real(*args, rank=rank, **kwargs)
        if rank == 1:
            time.sleep(0.5)

    monkeypatch.setattr(dist, "init_process_group", slow_end_for_rank_1)
    started = run_world(_started_at, 2)
    assert started[0] > started[1] - 0.25  # rank 0 waited for rank 1's half second


def test_worlds_started_from_eight_threads_do_not_collide():
    results, errors = {}, []

    def one(i):
        try:
            results[i] = run_world(_sum_ranks, 2, 1.0, offset=100.0 * i)
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # Each world saw only its own ranks' values: 1 + 2 * 100 i.
    for i, per_rank in results.items():
        assert [r["t"].item() for r in per_rank] == [1.0 + 200.0 * i] * 2


def _torchrun_fn(rank, world_size):
    t = torch.ones(1)
    dist.all_reduce(t)
    return rank, world_size, t.item(), dist.is_initialized()


def test_under_torchrun_it_runs_only_this_rank(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    try:
        assert run_world(_torchrun_fn, 1, backend="gloo") == [(0, 1, 1.0, True)]
        with pytest.raises(ValueError, match="torchrun started 1 ranks"):
            run_world(_torchrun_fn, 2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_free_port_is_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", launch.free_port()))


def test_nccl_needs_a_gpu_per_rank():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    with pytest.raises(ValueError, match="a GPU per rank"):
        run_world(_sum_ranks, 2, 1.0, backend="nccl")
