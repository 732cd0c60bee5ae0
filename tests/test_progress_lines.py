"""The end-to-end tests' progress lines reach the terminal through pytest's capture, from the
main process and from an xdist worker, and a session without end-to-end tests gets none."""

import sys
import textwrap
from pathlib import Path

import pytest

from progress_lines import clock

pytest_plugins = ["pytester"]
HERE = Path(__file__).resolve().parent

SUITE = {
    "conftest.py": f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import pytest
        from progress_lines import Lines, runs_e2e

        @pytest.fixture(scope="session")
        def long_step(request):
            say = Lines(request.config, "long step", "about 1 s", on=runs_e2e(request.session))
            say("unit 1 of 1")
            print("a captured print")
            return 1
        """,
    "test_suite.py": """
        import pytest

        @pytest.mark.e2e
        def test_end_to_end(long_step):
            assert long_step

        def test_plain(long_step):
            assert long_step
        """,
}


@pytest.fixture
def suite(pytester):
    pytester.makeini("[pytest]\nmarkers =\n    e2e: end to end\n")
    for name, text in SUITE.items():
        pytester.path.joinpath(name).write_text(textwrap.dedent(text))
    return pytester


@pytest.mark.parametrize("workers", [[], ["-n", "1"]])
def test_an_end_to_end_session_sees_each_unit_as_it_is_done(suite, workers):
    done = suite.runpytest_subprocess("-p", "no:randomly", "-m", "e2e", *workers)
    done.assert_outcomes(passed=1)  # xdist counts the deselected test its own way
    said = [line for line in done.outlines + done.errlines if "long step: unit 1 of 1" in line]
    assert len(said) == 1 and "so far; usually about 1 s)" in said[0], done.outlines + done.errlines
    assert not [line for line in done.outlines + done.errlines if "a captured print" in line]


def test_other_sessions_stay_quiet(suite):
    done = suite.runpytest_subprocess("-p", "no:randomly", "-m", "not e2e")
    done.assert_outcomes(passed=1, deselected=1)
    assert not [line for line in done.outlines + done.errlines if "long step" in line]


def test_clock_reads_like_a_wall_clock():
    assert [clock(s) for s in (0.4, 41, 60, 365.6)] == ["0 s", "41 s", "1 m 00 s", "6 m 06 s"]
