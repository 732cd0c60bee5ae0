"""Each lab's stated time adds up from its sections, names every section, and the README's
prerequisites-and-hours table says the same hours and points."""

import re
from pathlib import Path

import pytest

from autograder import notebook, profiles
from autograder.engine.items import all_labs

ROOT = Path(__file__).resolve().parents[1]
TIME = re.compile(r"\*\*Time:\*\* about ([\d.]+) hours .*?by section in minutes: (.*?)\.", re.S)


def _stated(lab: str) -> tuple[float, dict[str, int]]:
    text = (ROOT / "labs" / f"{lab}.py").read_text().replace("\n# ", " ")  # the markdown's lines joined
    found = TIME.search(text)
    assert found, f"{lab} states no '**Time:** about N hours ... by section in minutes: ...'"
    flat = " ".join(found.group(2).replace("#", " ").split())
    sections = {n: int(m) for n, m in re.findall(r"§(\d+) (\d+)", flat)}
    return float(found.group(1)), sections


@pytest.mark.parametrize("lab", sorted(all_labs()))
def test_a_labs_time_names_each_section_and_adds_up(lab):
    hours, sections = _stated(lab)
    numbered = re.findall(r"^# ## (\d+)\.", (ROOT / "labs" / f"{lab}.py").read_text(), re.M)
    assert list(sections) == numbered
    # The total is the sections' sum rounded to a quarter of an hour.
    assert hours == round(sum(sections.values()) / 60 * 4) / 4


def test_the_readme_table_has_each_labs_hours_and_points():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("### Prerequisites and hours"):]
    cpu = profiles.load("cpu")
    for name, lab in sorted(all_labs().items()):
        number, topic = name.split("_", 1)
        row = next((line for line in table.splitlines() if line.startswith(f"| {number} ")), None)
        assert row, f"no row for lab {number}"
        cells = [c.strip() for c in row.strip("|").split("|")]
        gpu = sum(i.points for i in lab.items if notebook.needs_gpu(i, cpu))
        assert float(cells[2]) == _stated(name)[0], name
        assert (int(cells[3]), int(cells[4])) == (sum(i.points for i in lab.items) - gpu, gpu), name


# An intro part's estimate: "*(section 4, about 50 minutes" or "*(sections 6, 8 and 9, about 60
# minutes". A lettered section ("6a") is the numbered section's core; "6b" is an optional extra
# the section-by-section time leaves out, so it is not counted.
PART = re.compile(r"\*\(sections? ([\dab–, and]+?), about (\d+) minutes")


def _parts(lab: str) -> list[tuple[list[int], int]]:
    text = (ROOT / "labs" / f"{lab}.py").read_text()
    intro = " ".join(text[:text.index("**Time:**")].replace("\n# ", " ").split())
    parts = []
    for label, minutes in PART.findall(intro):
        if "b" in label:
            continue
        numbers = []
        for a, b in re.findall(r"(\d+)[a]?(?:–(\d+))?", label):
            numbers += list(range(int(a), int(b or a) + 1))
        parts.append((numbers, int(minutes)))
    return parts


@pytest.mark.parametrize("lab", sorted(all_labs()))
def test_the_intros_parts_cover_each_section_once_with_its_minutes(lab):
    _, sections = _stated(lab)
    parts = _parts(lab)
    covered = sorted(n for numbers, _ in parts for n in numbers)
    assert covered == sorted(int(n) for n in sections), f"{lab}: the intro's parts name {covered}"
    for numbers, minutes in parts:
        assert minutes == sum(sections[str(n)] for n in numbers), f"{lab}: sections {numbers}"
