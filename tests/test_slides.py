"""The lecture decks build to HTML that presents offline (slides/build_decks.py, `make slides`)."""

import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SLIDES = Path(__file__).resolve().parent.parent / "slides"
sys.path.insert(0, str(SLIDES))
import build_decks as slides_build  # noqa: E402
import deck_figures as figures  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    try:
        slides_build.marp_executable()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("slides")
    start = time.perf_counter()
    pages = slides_build.build(out)
    print(f"built {len(pages)} decks in {time.perf_counter() - start:.1f} s")
    return out, pages


def test_every_deck_builds_and_presents_offline(built):
    out, pages = built
    assert [p.stem for p in pages] == [d.stem for d in slides_build.decks()]
    for page in pages:
        text = page.read_text()
        assert "<section" in text, f"{page.name} has no slides"
        # Math is rendered at build time (inline SVG), not by a script fetched when presenting.
        assert slides_build.offline_problems(page) == []


def test_every_figure_is_drawn_and_shown(built):
    out, pages = built
    shown = "".join(p.read_text() for p in pages)
    for name in figures.FIGURES:
        png = out / "figures" / f"{name}.png"
        assert png.stat().st_size > 10_000, f"{name}.png is nearly empty"
        assert f"figures/{name}.png" in shown, f"no deck shows {name}.png"


@pytest.mark.parametrize("snippet, complaint", [
    ('<img src="https://example.org/plot.png">', "from the network"),
    ("<style>@import 'http://fonts.example/x.css';</style>", "from the network"),
    ('<div style="background:url(//cdn.example/bg.png)"></div>', "from the network"),
    ('<img srcset="figures/a.png 1x, https://cdn.example/a@2x.png 2x">', "from the network"),
    ('<link rel="stylesheet" href="theme/missing.css">', "not a file beside it"),
])
def test_offline_check_catches_remote_and_missing_references(tmp_path, snippet, complaint):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"png")
    page = tmp_path / "deck.html"
    page.write_text(f"<html><body>{snippet}<svg xmlns='http://www.w3.org/2000/svg'><use href='#g1'/></svg>"
                    f"<img src='data:image/png;base64,AA=='><img src='figures/a.png'></body></html>")
    problems = slides_build.offline_problems(page)
    assert len(problems) == 1 and complaint in problems[0], problems
