"""Lab 01's ``grouped_order``, judged in the parent on the whole mapping of every hidden grid."""

from __future__ import annotations

from autograder.labs import lab01_gemm as lab
from fastdl_lab.gemm import grouped_pid_ref


def test_every_hidden_set_of_grids_has_a_shorter_last_band():
    for seed in range(20):
        cases = lab.grouped_inputs(seed, {})["cases"]
        assert len(cases) == 12
        assert sum(1 for m, _, g in cases if g < m and m % g) >= 2


def test_the_whole_mapping_of_every_grid_is_required():
    given = lab.grouped_inputs(5, {})
    honest = lab.grouped_drive({"grouped_pid": grouped_pid_ref}, given)
    assert lab.grouped_check(given, honest, {}).fraction == 1.0
    empty = lab.grouped_check(given, [[] for _ in honest], {})
    assert empty.fraction == 0 and "all" in empty.reason
    shortened = [answer[:-1] for answer in honest]
    assert lab.grouped_check(given, shortened, {}).fraction == 0
    tuples = [[tuple(pair) for pair in answer] for answer in honest]
    assert lab.grouped_check(given, tuples, {}).fraction == 0


def test_an_order_that_ignores_the_shorter_band_fails():
    def full_bands(pid, num_pid_m, num_pid_n, group_m):
        per_group = group_m * num_pid_n
        local = pid % per_group
        return (pid // per_group) * group_m + local % group_m, local // group_m

    given = lab.grouped_inputs(11, {})
    answers = [[list(full_bands(pid, m, n, g)) for pid in range(m * n)] for m, n, g in given["cases"]]
    assert lab.grouped_check(given, answers, {}).fraction == 0
