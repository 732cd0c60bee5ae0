"""Build every lecture deck to HTML that presents offline: ``python slides/build_decks.py OUT_DIR``.

Each ``slides/NN_*.md`` becomes ``OUT_DIR/NN_*.html`` through Marp CLI (its default theme has no
web fonts, and its math is rendered to inline SVG at build time), with the figures drawn by
``slides/deck_figures.py`` in ``OUT_DIR/figures/``. The build then reads every page back and fails if
one would fetch anything from the network or points at a local file that is not there: a deck
shown in a lecture hall without a connection must look the way it did when it was built.

Marp CLI comes from the npm registry into the project's build folder (``make slides-tool``);
``FASTDL_MARP`` names another ``marp`` executable.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

SLIDES = Path(__file__).resolve().parent
ROOT = SLIDES.parent
DEFAULT_MARP = ROOT / "build" / "cache" / "npm" / "node_modules" / ".bin" / "marp"

sys.path.insert(0, str(SLIDES))
import deck_figures as figures  # noqa: E402

# Everything in a page that makes the browser load something: attributes, CSS url() and @import.
_ATTR = re.compile(r"""\b(src|href|srcset|poster|data|action|formaction)\s*=\s*(["'])(.*?)\2""", re.I | re.S)
_CSS_URL = re.compile(r"""url\(\s*(["']?)(.*?)\1\s*\)""", re.I | re.S)
_IMPORT = re.compile(r"""@import\s+(["'])(.*?)\1""", re.I)
# Where a bare "//host/path" or a scheme would make the browser go out.
_REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.I)
_INLINE = ("data:", "#", "javascript:", "about:", "mailto:")


def marp_executable() -> Path:
    marp = Path(os.environ.get("FASTDL_MARP", DEFAULT_MARP))
    if not marp.is_file():
        raise FileNotFoundError(f"Marp CLI not found at {marp}: run `make slides-tool` (npm install into "
                                f"build/cache/npm) or set FASTDL_MARP to a marp executable")
    return marp


def decks() -> list[Path]:
    found = sorted(SLIDES.glob("[0-9][0-9]_*.md"))
    if not found:
        raise FileNotFoundError(f"no decks (NN_*.md) in {SLIDES}")
    return found


def _references(page: str):
    """Every URL the page would load, with the construct it came from."""
    for match in _ATTR.finditer(page):
        value = html.unescape(match.group(3))
        if match.group(1).lower() == "srcset":
            # Candidates separated by commas, each a URL and an optional width or density.
            for candidate in value.split(","):
                yield "srcset", candidate.strip().split(" ")[0]
        else:
            yield match.group(1).lower(), value
    for match in _CSS_URL.finditer(page):
        yield "url()", html.unescape(match.group(2))
    for match in _IMPORT.finditer(page):
        yield "@import", html.unescape(match.group(2))


def offline_problems(page_path: Path) -> list[str]:
    """Why ``page_path`` would not present offline: remote references and missing local files."""
    page = page_path.read_text(encoding="utf-8")
    problems = []
    for kind, url in _references(page):
        url = url.strip()
        if not url or url.lower().startswith(_INLINE):
            continue
        if _REMOTE.match(url) or urlsplit(url).scheme not in ("", "file"):
            problems.append(f"{page_path.name}: {kind} loads {url[:120]!r} from the network")
            continue
        target = (page_path.parent / unquote(urlsplit(url).path)).resolve()
        if not target.is_file():
            problems.append(f"{page_path.name}: {kind} points at {url!r}, which is not a file beside it")
    return problems


def build(out_dir: Path) -> list[Path]:
    """Figures, then every deck into ``out_dir``; returns the HTML pages.

    Raises RuntimeError naming every page that would not present offline.
    """
    out_dir = Path(out_dir).resolve()
    marp = marp_executable()
    sources = decks()
    figures.write_all(out_dir / "figures")
    # One Marp process for all decks (its start-up is most of the cost). It mirrors the folder, so
    # NN_*.html land in out_dir beside figures/, which the decks' relative image paths expect.
    result = subprocess.run([str(marp), "--no-stdin", "--html=false", "--input-dir", str(SLIDES),
                             "--output", str(out_dir)], capture_output=True, text=True, cwd=ROOT)
    pages = [out_dir / f"{deck.stem}.html" for deck in sources]
    missing = [page.name for page in pages if not page.is_file()]
    if result.returncode != 0 or missing:
        raise RuntimeError(f"marp failed (exit {result.returncode}; pages missing: {missing}):\n"
                           f"{result.stderr[-2000:]}")
    problems = [p for page in pages for p in offline_problems(page)]
    if problems:
        raise RuntimeError("decks that would not present offline:\n  " + "\n  ".join(problems))
    return pages


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python slides/build_decks.py OUT_DIR")
    try:
        for built in build(Path(sys.argv[1])):
            print(built)
    except (FileNotFoundError, RuntimeError) as exc:
        sys.exit(str(exc))
