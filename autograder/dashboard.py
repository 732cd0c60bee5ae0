"""The instructor's dashboard: every grading record summarised on one HTML page.

Per lab: how each item's scores spread, each student's total, the commonest reasons an item was
not passed. Across labs: the speed-ups measured on each hardware profile and how long each
submission took to grade. The page carries its plots as inline PNGs and has no script and no
link to fetch, so it opens offline, from a mail attachment or a shared drive, exactly as written.
Student names and reasons are whatever a student chose: every string from a record is cleaned
and escaped before it reaches the page.
"""

from __future__ import annotations

import base64
import html
import io
import math
import re
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from autograder import hints, profiles, records as grading_records

LEFT_OUT = "needs_gpu"  # not graded on this profile: shown, never counted
TOP_REASONS = 5
SLOWEST = 5
NO_GPU_SPEED = "no speed items graded on a GPU profile"
EMPTY = "No grading records yet: grade a lab, then write the dashboard again."
_NUMBER = re.compile(r"\d+(?:\.\d+)?")

_STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.left-out { color: #a15c00; }
.note { color: #555; }
.reason { white-space: pre-wrap; font-size: 90%; }
img { max-width: 100%; }
"""


def _h(value: object) -> str:
    """``value`` safe to place in the page, as text or inside an attribute. Control and bidi
    characters go too: they could make one student's row read as another's."""
    return html.escape(grading_records.clean_reason(value), quote=True)


def _plot_text(value: object) -> str:
    # Matplotlib reads text between dollar signs as mathematics and raises on a malformed formula.
    return grading_records.clean_reason(value).replace("$", r"\$")


def _img(fig: Figure, alt: str) -> str:
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<p><img alt="{_h(alt)}" src="data:image/png;base64,{data}"></p>'


def _table(header: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """``rows`` hold HTML already made safe by the caller; the header is plain text."""
    head = "".join(f"<th>{_h(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _number(value: object) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _grid(count: int, width: float = 4.0, height: float = 2.6) -> tuple[Figure, list]:
    cols = min(3, count)
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(width * cols, height * rows), dpi=72, layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, list(axes[:count])


def _items_in_order(lab_records: list[dict]) -> list[str]:
    # The order a lab grades its items in is the order a student meets them in the notebook.
    return list(dict.fromkeys(item["item"] for r in lab_records for item in r.get("items", [])))


def normalise_reason(reason: object) -> str:
    """One form for reasons that differ only in their figures ("took 3.1 s" and "took 12 s")."""
    return _NUMBER.sub("#", grading_records.clean_reason(reason)).strip()


def student_totals(record: dict) -> dict[str, float]:
    """Counted score and maximum, and the points left out because they need a GPU."""
    total = {"score": 0.0, "max": 0.0, "left_out": 0.0}
    for item in record.get("items", []):
        if item["status"] == LEFT_OUT:
            total["left_out"] += float(item["max_score"])
        else:
            total["score"] += float(item["score"])
            total["max"] += float(item["max_score"])
    return total


def grading_seconds(record: dict) -> dict:
    """nbgrader, engine and total seconds for one submission. Records written before the grader
    kept its own clock are timed as nbgrader's seconds plus each item's wall time."""
    recorded = record.get("seconds")
    if isinstance(recorded, dict) and _number(recorded.get("total")) is not None:
        return {"nbgrader": _number(recorded.get("nbgrader")), "engine": _number(recorded.get("engine")),
                "total": _number(recorded["total"]), "source": "recorded"}
    nbgrader = _number((record.get("nbgrader") or {}).get("seconds")) or 0.0
    engine = sum(_number(item.get("wall_s")) or 0.0 for item in record.get("items", []))
    return {"nbgrader": nbgrader, "engine": engine, "total": nbgrader + engine, "source": "nbgrader + items"}


def failure_reasons(lab_records: list[dict]) -> dict[str, list[dict]]:
    """Per item, the reasons it was not passed, commonest first: pattern, count, statuses and one
    example. Items left out for needing a GPU did not fail and are counted in the totals instead."""
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for record in lab_records:
        for item in record.get("items", []):
            if item["status"] in ("passed", LEFT_OUT):
                continue
            pattern = normalise_reason(item["reason"])
            group = groups[item["item"]].setdefault(pattern, {
                "pattern": pattern, "count": 0, "statuses": Counter(),
                "example": item["reason"], "student": record["student"]})
            group["count"] += 1
            group["statuses"][item["status"]] += 1
    return {item: sorted(found.values(), key=lambda g: (-g["count"], g["pattern"])) for item, found in groups.items()}


@cache
def _profile_on_gpu(name: str) -> bool | None:
    return bool(profiles.load(name).get("gpu")) if name in profiles.available() else None


def _gpu_profile(record: dict) -> bool:
    on_gpu = _profile_on_gpu(str(record.get("profile")))
    if on_gpu is not None:
        return on_gpu
    # A profile since renamed or removed: the hardware the record was graded on is the best witness.
    return (record.get("hardware") or {}).get("kind") not in (None, "cpu")


def speedups(all_records: list[dict]) -> list[dict]:
    """One row per speed item graded: lab, item, profile, device, speedup and whether the
    profile grades speed on a GPU."""
    rows = []
    for record in all_records:
        on_gpu = _gpu_profile(record)
        for item in record.get("items", []):
            speedup = _number((item.get("details") or {}).get("speedup"))
            if speedup is None or item["status"] == LEFT_OUT:
                continue
            rows.append({"lab": record["lab"], "item": item["item"], "profile": str(record.get("profile")),
                         "device": str((record.get("hardware") or {}).get("name", "unknown")),
                         "speedup": speedup, "gpu_profile": on_gpu})
    return rows


def _lab_section(index: int, lab: str, lab_records: list[dict]) -> str:
    parts = [f'<h2 id="lab-{index}">Lab {_h(lab)}</h2>']
    items = _items_in_order(lab_records)
    fractions: dict[str, list[float]] = defaultdict(list)
    left_out: Counter = Counter()
    for record in lab_records:
        for item in record.get("items", []):
            if item["status"] == LEFT_OUT:
                left_out[item["item"]] += 1
            elif float(item["max_score"]) > 0:
                fractions[item["item"]].append(float(item["score"]) / float(item["max_score"]))

    parts.append("<h3>Score distribution per item</h3>")
    rows = []
    for name in items:
        got = fractions[name]
        rows.append([_h(name), str(len(got)), str(sum(f == 1.0 for f in got)),
                     f"{np.mean(got):.0%}" if got else "–",
                     f'<span class="left-out">{left_out[name]}</span>' if left_out[name] else "0"])
    parts.append(_table(["item", "graded", "full marks", "mean score", "left out (needs a GPU)"], rows, {1, 2, 3, 4}))
    plotted = [name for name in items if fractions[name]]
    if plotted:
        fig, axes = _grid(len(plotted))
        for ax, name in zip(axes, plotted):
            ax.hist(fractions[name], bins=np.linspace(0, 1, 11), color="#4878a8", edgecolor="white")
            ax.set_title(_plot_text(name), fontsize=10)
            ax.set_xlim(0, 1)
            ax.set_xlabel("score / max")
            ax.set_ylabel("submissions")
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        parts.append(_img(fig, f"histograms of score over maximum for each item of {lab}"))

    parts.append("<h3>Totals per student</h3>")
    rows = []
    for record in sorted(lab_records, key=lambda r: str(r["student"])):
        t = student_totals(record)
        share = f"{t['score'] / t['max']:.0%}" if t["max"] else "–"
        gpu = f'<span class="left-out">{t["left_out"]:g} left out (needs a GPU)</span>' if t["left_out"] else ""
        rows.append([_h(record["student"]), f"{t['score']:g} / {t['max']:g}", share, gpu])
    parts.append(_table(["student", "score", "share", "GPU-only points"], rows, {1, 2}))

    parts.append("<h3>Most common reasons an item was not passed</h3>")
    reasons = failure_reasons(lab_records)
    if not reasons:
        parts.append('<p class="note">Every graded item was passed.</p>')
    rows = []
    for name in items:
        groups = reasons.get(name, [])
        for group in groups[:TOP_REASONS]:
            statuses = ", ".join(f"{s} ×{n}" if n > 1 else s for s, n in sorted(group["statuses"].items()))
            rows.append([_h(name), str(group["count"]), _h(statuses),
                         f'<span class="reason">{_h(group["pattern"])}</span>',
                         f'{_h(group["student"])}: <span class="reason">{_h(group["example"])}</span>'])
        if len(groups) > TOP_REASONS:
            rest = groups[TOP_REASONS:]
            rows.append([_h(name), str(sum(g["count"] for g in rest)), "",
                         f'<span class="note">{len(rest)} other reasons</span>', ""])
    if rows:
        parts.append(_table(["item", "count", "status", "reason (figures as #)", "example"], rows, {1}))
    return "\n".join(parts)


def _speed_section(all_records: list[dict]) -> str:
    parts = ['<h2 id="speed">Speed-ups by hardware profile</h2>']
    rows = speedups(all_records)
    if not any(r["gpu_profile"] for r in rows):
        parts.append(f"<p><strong>{_h(NO_GPU_SPEED)}</strong>"
                     + (" (speed-ups measured on CPU profiles follow)." if rows else ".") + "</p>")
    if not rows:
        return "\n".join(parts)
    by_item: dict[tuple[str, str], dict[tuple[str, str, bool], list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_item[(r["lab"], r["item"])][(r["profile"], r["device"], r["gpu_profile"])].append(r["speedup"])
    fig, axes = _grid(len(by_item), width=4.6, height=3.2)
    jitter = np.random.default_rng(0)  # a fixed spread: the same records draw the same page
    table = []
    for ax, ((lab, item), groups) in zip(axes, sorted(by_item.items())):
        keys = sorted(groups)
        values = [groups[k] for k in keys]
        ax.boxplot(values, widths=0.5, showfliers=False)
        for position, vals in enumerate(values, start=1):
            ax.plot(position + jitter.uniform(-0.12, 0.12, len(vals)), vals, "o", alpha=0.6, color="#c44e52")
        ax.set_xticks(range(1, len(keys) + 1), [_plot_text(f"{p}\n{d[:24]}") for p, d, _ in keys], fontsize=7)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_yscale("log")
        ax.set_ylabel("speed-up (x)")
        ax.set_title(_plot_text(f"{lab} · {item}"), fontsize=10)
        for (profile, device, on_gpu), vals in zip(keys, values):
            table.append([_h(lab), _h(item), _h(profile) + ("" if on_gpu else " (CPU)"), _h(device), str(len(vals)),
                          f"{np.median(vals):.2f}x", f"{min(vals):.2f}x", f"{max(vals):.2f}x"])
    parts.append(_img(fig, "speed-ups per speed item, grouped by hardware profile and device"))
    header = ["lab", "item", "profile", "device", "submissions", "median", "min", "max"]
    parts.append(_table(header, table, {4, 5, 6, 7}))
    return "\n".join(parts)


def _time_section(all_records: list[dict]) -> str:
    parts = ['<h2 id="time">Grading time per submission</h2>']
    timed = [(grading_seconds(r), r) for r in all_records]
    totals = [t["total"] for t, _ in timed]
    parts.append(f'<p>{len(totals)} submissions, {sum(totals) / 60:.1f} min in all, '
                 f'median {np.median(totals):.1f} s. nbgrader runs beside the engine: a total is less than '
                 f'their sum. Records that predate the grader\'s own clock show nbgrader\'s time plus each '
                 f'item\'s.</p>')
    fig = Figure(figsize=(7, 3), dpi=72, layout="constrained")
    ax = fig.subplots()
    ax.hist(totals, bins=min(20, max(5, len(totals))), color="#55a868", edgecolor="white")
    ax.set_xlabel("seconds per submission (wall time)")
    ax.set_ylabel("submissions")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    parts.append(_img(fig, "histogram of grading time per submission"))
    parts.append(f"<h3>The {min(SLOWEST, len(timed))} slowest</h3>")
    slowest = sorted(timed, key=lambda tr: -tr[0]["total"])[:SLOWEST]
    fmt = lambda s: "–" if s is None else f"{s:.1f}"  # noqa: E731
    rows = [[_h(r["student"]), _h(r["lab"]), fmt(t["nbgrader"]), fmt(t["engine"]), fmt(t["total"]), _h(t["source"])]
            for t, r in slowest]
    parts.append(_table(["student", "lab", "nbgrader s", "engine s", "total s", "from"], rows, {2, 3, 4}))
    return "\n".join(parts)


def render(all_records: list[dict]) -> str:
    """The whole page as a string."""
    title = "fastdl-lab grading dashboard"
    head = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{title}</h1>")
    if not all_records:
        how = f"{EMPTY} Lab 01, for one: {hints.autograder('autograde 01_gemm')}"
        return f'{head}<p class="note">{_h(how)}</p></body></html>\n'
    by_lab: dict[str, list[dict]] = defaultdict(list)
    for record in all_records:
        by_lab[str(record["lab"])].append(record)
    labs = sorted(by_lab)
    students = {str(r["student"]) for r in all_records}
    dates = sorted(str(r.get("graded_at", "")) for r in all_records)
    nav = " · ".join(f'<a href="#lab-{i}">{_h(lab)}</a>' for i, lab in enumerate(labs))
    body = [f"<p>{len(all_records)} records: {len(students)} students, {len(labs)} labs, graded "
            f"{_h(dates[0])} to {_h(dates[-1])}.</p>",
            f'<p>{nav} · <a href="#speed">speed-ups</a> · <a href="#time">grading time</a></p>']
    body += [_lab_section(i, lab, by_lab[lab]) for i, lab in enumerate(labs)]
    body += [_speed_section(all_records), _time_section(all_records)]
    return head + "\n".join(body) + "\n</body></html>\n"


def write_html(records: list[dict], path: Path) -> Path:
    """Write the dashboard for ``records`` (as ``records.read_all`` gives them) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name may carry bytes the file system allowed but UTF-8 cannot encode: never let one stop the page.
    path.write_text(render(records), encoding="utf-8", errors="backslashreplace")
    return path
