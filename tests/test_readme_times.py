"""The README states each set-up and test time once, and where a figure is also said elsewhere (a
progress line, a log line, the Makefile's messages) the two are the same words. make test-e2e's
total must cover the parts its own sections give."""

import re
from pathlib import Path

import e2e_times
from autograder import formgrader

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()


def flat(text: str) -> str:
    """Words as a reader reads them: a figure may be wrapped across lines."""
    return " ".join(text.split())


def seconds(figure: str) -> float:
    """``about 7 minutes`` or ``about 45 s``, in seconds."""
    found = re.fullmatch(r"about (\d+) (minutes|s)", figure)
    assert found, f"not a figure this test reads: {figure!r}"
    return int(found[1]) * (60 if found[2] == "minutes" else 1)


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return flat(README[start:end])


def test_the_e2e_progress_lines_say_the_readmes_figures():
    browser, hub = section("Browser tests"), section("The course on JupyterHub")
    assert f"the session fixture the pipeline tests share, {e2e_times.DEMO_CLASS}" in browser
    assert f"(`make test-e2e`; {e2e_times.HUB_TERM})" in hub
    assert f"(`python -m autograder build`; the first time, {e2e_times.COURSE_BUILD})" in flat(README)


def test_formgraders_log_says_the_readmes_figure():
    assert formgrader.USUAL in section("The course on JupyterHub")


def test_make_test_e2e_takes_at_least_its_parts():
    total = re.search(r"`make test-e2e` runs the end-to-end tests kept out of `make test` for time "
                      r"\((about \d+ minutes) more on the 2-core machine", flat(README))
    assert total, "the intro's figure for make test-e2e"
    demo = re.fullmatch(r"(about \d+ minutes) on the 2-core machine", e2e_times.DEMO_CLASS)
    hub = re.fullmatch(r"(about \d+ s) on the 2-core machine", e2e_times.HUB_TERM)
    browser = re.search(r"then adds (about \d+ s)", section("Browser tests"))
    assert demo and hub and browser
    parts = seconds(demo[1]) + seconds(hub[1]) + seconds(browser[1])
    assert seconds(total[1]) >= parts, f"make test-e2e: {total[1]}, its parts {parts / 60:.1f} minutes"


def test_the_makefile_and_the_readme_give_the_same_figures():
    readme = flat(README)
    venv = re.search(r"2\.8 GB, (\d+-\d+ minutes) the first time on the 2-core machine", MAKEFILE)
    assert venv and f"(2.8 GB; {venv[1]} on the 2-core machine" in readme
    assert "under 20 minutes on the 2-core machine" in MAKEFILE
    assert "run the test suite (under 20 minutes on the 2-core machine)" in readme
    proxy = re.search(r"configurable-http-proxy .*?: (9 MB), about (\d+ s) on 2 cores", MAKEFILE)
    assert proxy and f"JupyterHub's proxy {proxy[1]} in {proxy[2]}" in readme
