"""The instructor's dashboard, from synthetic grading records (nothing is graded here)."""

import json
import re

import pytest

from autograder import cli, dashboard, records

LAB = "01_gemm"


def item(name, score, max_score, status="passed", reason="ok", wall_s=1.0, details=None):
    return {"item": name, "score": score, "max_score": max_score, "status": status, "reason": reason,
            "counted": status != "needs_gpu", "wall_s": wall_s, "details": details or {}}


def record(student, items, *, lab=LAB, profile="cpu", device="AMD EPYC", kind="cpu", nb_seconds=10.0, seconds=None):
    found = {"lab": lab, "student": student, "graded_at": "2026-01-05T10:00:00Z", "profile": profile, "seed": 7,
             "hardware": {"kind": kind, "name": device}, "versions": {},
             "nbgrader": {"returncode": 0, "message": "", "seconds": nb_seconds}, "items": items}
    if seconds is not None:
        found["seconds"] = seconds
    return found


def stored(tmp_path, found):
    """``found`` written as the grader writes records, and read back the way the CLI reads them."""
    folder = tmp_path / "course" / "records"
    for r in found:
        path = folder / r["lab"] / f"{r['student']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r))
    return records.read_all(folder)


def cpu_class():
    """Three students fail the same way with different figures, one passes; speed needs a GPU."""
    speed = item("matmul_speed", 0.0, 2, "needs_gpu", "needs a GPU: left out of the total", wall_s=0.0)
    slow = [record(f"s{i}", [item("matmul", 0.0, 4, "failed", f"took {t} s for {n} cases, allowed 2 s", 3.0), speed])
            for i, (t, n) in enumerate([(3.1, 8), (12, 16), (7.25, 8)])]
    return slow + [record("ace", [item("matmul", 4.0, 4), speed]),
                   record("ace", [item("loader", 1.0, 2, "partial", "half right", 2.0)], lab="06_data")]


def test_every_section_with_the_right_counts(tmp_path):
    page = dashboard.write_html(stored(tmp_path, cpu_class()), tmp_path / "out" / "dash.html").read_text()
    for heading in ("Score distribution per item", "Totals per student", "Most common reasons an item was not passed",
                    "Speed-ups by hardware profile", "Grading time per submission", "Lab 01_gemm", "Lab 06_data"):
        assert heading in page
    # matmul graded 4 times, once with full marks; the speed item left out for all 4
    assert '<td>matmul</td><td class="n">4</td><td class="n">1</td><td class="n">25%</td>' in page
    assert '<td>matmul_speed</td><td class="n">0</td>' in page and '<span class="left-out">4</span>' in page
    # the three failures differ only in figures: one reason, seen 3 times, with one of them as the example
    assert '<td>matmul</td><td class="n">3</td><td>failed ×3</td>' in page
    assert "took # s for # cases, allowed # s" in page and "took 3.1 s for 8 cases, allowed 2 s" in page
    assert "half right" in page and "needs a GPU: left out of the total" not in page
    assert page.count('4 / 4</td><td class="n">100%</td><td><span class="left-out">2 left out (needs a GPU)') == 1
    assert dashboard.NO_GPU_SPEED in page
    # five students' records fill the slowest-five table exactly: nbgrader 10 s plus their items' wall time
    slowest = page.split("slowest")[1]
    assert slowest.count("<tr>") == 1 + 5 and '<td class="n">13.0</td>' in slowest
    assert page.count("<img ") == 3  # one histogram grid per lab, grading time; no speed item to plot


def test_reasons_group_by_their_words_not_their_figures():
    groups = dashboard.failure_reasons(cpu_class()[:4])["matmul"]
    seen = [(g["pattern"], g["count"], g["student"]) for g in groups]
    assert seen == [("took # s for # cases, allowed # s", 3, "s0")]
    assert dashboard.normalise_reason("rank 3 timed out after 20.5 s\x1b[2J") == "rank # timed out after # s?[#J"


def test_totals_show_gpu_points_as_left_out():
    slow = cpu_class()[0]
    assert dashboard.student_totals(slow) == {"score": 0.0, "max": 4.0, "left_out": 2.0}


def test_grading_time_uses_the_recorded_clock_and_falls_back_on_nbgrader_plus_items():
    seconds = {"nbgrader": 5.0, "engine": 40.0, "total": 45.5}
    assert dashboard.grading_seconds(record("a", [item("x", 1, 1, wall_s=3.0)], seconds=seconds))["total"] == 45.5
    older = dashboard.grading_seconds(record("a", [item("x", 1, 1, wall_s=3.0), item("y", 1, 1, wall_s=4.5)]))
    assert older == {"nbgrader": 10.0, "engine": 7.5, "total": 17.5, "source": "nbgrader + items"}


def test_speed_ups_grouped_by_profile_and_device(tmp_path):
    fast = lambda s: item("matmul_speed", 2.0, 2, details={"speedup": s})  # noqa: E731
    found = [record("a", [fast(2.0)], profile="h100", device="NVIDIA H100 80GB HBM3", kind="cuda"),
             record("b", [fast(4.0)], profile="h100", device="NVIDIA H100 80GB HBM3", kind="cuda"),
             record("c", [fast(3.0)], profile="h100", device="NVIDIA H100 80GB HBM3", kind="cuda"),
             # a profile no longer shipped: the hardware it ran on decides
             record("d", [fast(1.5)], profile="retired-gpu", device="Tesla V100", kind="cuda")]
    rows = dashboard.speedups(found)
    assert [(r["profile"], r["gpu_profile"]) for r in rows] == [("h100", True)] * 3 + [("retired-gpu", True)]
    page = dashboard.write_html(stored(tmp_path, found), tmp_path / "dash.html").read_text()
    assert dashboard.NO_GPU_SPEED not in page
    assert ('<td>h100</td><td>NVIDIA H100 80GB HBM3</td><td class="n">3</td><td class="n">3.00x</td>'
            '<td class="n">2.00x</td><td class="n">4.00x</td>') in page
    assert "<td>retired-gpu</td><td>Tesla V100</td>" in page


def test_student_controlled_text_is_inert(tmp_path):
    evil = "<script>alert(1)</script>"
    found = [record(evil, [item("matmul", 0.0, 4, "error", 'your code raised <img src=x onerror="alert(2)">',
                                details={"speedup": 0.5})],
                    device="GPU $\\frac{$ x", nb_seconds=99.0)]
    page = dashboard.write_html(found, tmp_path / "dash.html").read_text()
    assert "<script" not in page.lower() and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=&quot;alert(2)&quot;&gt;" in page
    # offline: every image is inline, nothing is fetched
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(s.startswith(("data:image/png;base64,", "#")) for s in sources)


def test_no_records_gives_a_page_that_says_so(tmp_path):
    page = dashboard.write_html(stored(tmp_path, []), tmp_path / "dash.html").read_text()
    assert dashboard.EMPTY in page and "<img" not in page and "<table" not in page


@pytest.fixture
def graded_course(tmp_path):
    stored(tmp_path, cpu_class())
    return tmp_path / "course"


@pytest.mark.parametrize("csv, html", [(True, True), (True, False), (False, True)])
def test_cli_writes_what_it_is_asked_for(graded_course, tmp_path, capsys, csv, html):
    argv = ["--course", str(graded_course), "report"]
    argv += ["--csv", str(tmp_path / "grades.csv")] if csv else []
    argv += ["--html", str(tmp_path / "dash.html")] if html else []
    assert cli.main(argv) == 0
    assert (tmp_path / "grades.csv").exists() is csv
    assert (tmp_path / "dash.html").exists() is html
    if html:
        assert str(tmp_path / "dash.html") in capsys.readouterr().out
        assert "Lab 06_data" in (tmp_path / "dash.html").read_text()


def test_cli_report_needs_csv_or_html(graded_course, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--course", str(graded_course), "report"])
    assert stopped.value.code == 2
    assert "--csv [FILE], --html [FILE], or both" in capsys.readouterr().err
