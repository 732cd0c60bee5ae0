"""Lab 07's FSDP and tensor-parallel items through the trusted engine (sandbox included): the
reference earns full marks, the release nothing, and each mistake loses its part with a reason."""

import pytest

from autograder.submissions import DEMO_DIR, FIXTURE_DIR, make_submission, reference_solutions, variant
from test_grading_pipeline import engine

pytestmark = pytest.mark.slow
LAB = "07_distributed"
ITEMS = {"fsdp", "fsdp_mixed", "tp_mlp"}


def test_reference_passes_every_sharding_item_quickly(course, cpu):
    make_submission(course, LAB, "sharding-reference", reference_solutions(course, LAB))
    results = engine(course, cpu, LAB, "sharding-reference", only=ITEMS)
    for item in ITEMS:
        assert results[item].status == "passed", results[item]
        assert results[item].score == results[item].max_score
        print(f"{item}: {results[item].wall_s:.1f} s")
    assert "1/N shard" in results["fsdp"].reason and "one all-reduce in forward" in results["tp_mlp"].reason


def test_untouched_release_scores_nothing(course, cpu):
    make_submission(course, LAB, "sharding-untouched", None)
    results = engine(course, cpu, LAB, "sharding-untouched", only=ITEMS)
    assert {r.status for r in results.values()} == {"unanswered"}
    assert sum(r.score for r in results.values()) == 0


# Each third of an FSDP item: parity; the collectives the relay carried; memory, which is, where
# the profile has a memory world (fsdp), half the ranks' cgroup peaks on a large model and half
# what the ranks counted themselves (self-reported), and otherwise (fsdp_mixed) the latter alone.
@pytest.mark.parametrize("path, lost", [
    # Full weights kept after every step: the peaks show them, and so do the ranks' own counts.
    pytest.param(DEMO_DIR / LAB / "buggy-fsdp-keeps-full-params.py",
                 {"fsdp": (2.0, "memory peak"), "fsdp_mixed": (4 / 3, "still holds")}, id="fsdp-keeps-full-params"),
    pytest.param(FIXTURE_DIR / f"{LAB}-mistake-tp-no-backward-allreduce.py", {"tp_mlp": (0.0, "dx")},
                 id="tp-no-backward-allreduce"),
    # One gather per unit and step on the relay; every unit still gathered when the next is, as the
    # ranks count it. On two ranks the peak of weights kept from forward to backward is no higher
    # than the sharded reference's (its optimizer state is as large): the peaks pass.
    pytest.param(FIXTURE_DIR / f"{LAB}-fsdp-no-reshard.py", {"fsdp": (1.5, "all-gathers")}, id="fsdp-no-reshard"),
])
def test_mistakes_lose_their_part_with_a_reason(course, cpu, path, lost):
    variant(course, LAB, path.stem, path)
    results = engine(course, cpu, LAB, path.stem, only=set(lost))
    for item, (score, words) in lost.items():
        assert results[item].score == pytest.approx(score, abs=0.01), results[item]
        assert words in results[item].reason, results[item].reason
