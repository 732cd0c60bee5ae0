"""Feedback pages need no network: every lab's equations become MathML, and nothing is loaded.

The browser test (test_browser.py) opens a real feedback page with the network blocked; these check
the HTML itself, quickly, on every lab's markdown.
"""

import html.parser
from pathlib import Path

import pytest
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath
from traitlets.config.loader import PyFileConfigLoader

from autograder import feedback_html
from autograder.course import Course, lab_sources, to_nbgrader_notebook, write_config


def lab_equations() -> list[tuple[str, str, bool]]:
    """(lab, TeX, display) for every equation nbconvert's Markdown parser finds in the labs."""
    found = []

    class Collect(IPythonRenderer):
        def inline_math(self, body):
            found.append((lab, body, False))
            return ""

        def block_math(self, body):
            found.append((lab, body, True))
            return ""

        def latex_environment(self, name, body):
            found.append((lab, f"\\begin{{{name}}}{body}\\end{{{name}}}", True))
            return ""

    for lab, path in lab_sources().items():
        for cell in to_nbgrader_notebook(path).cells:
            if cell.cell_type == "markdown":
                MarkdownWithMath(renderer=Collect(escape=False)).render(cell.source)
    return found


def test_every_equation_in_the_labs_becomes_mathml():
    equations = lab_equations()
    assert len({lab for lab, _, _ in equations}) > 5, "the labs' markdown should hold equations"
    failed = [(lab, tex) for lab, tex, display in equations
              if not feedback_html.tex_to_mathml(tex, display).startswith("<math")]
    assert failed == [], f"shown as TeX source, not MathML: {failed[:10]}"


def test_mathml_is_plain_and_block_math_is_displayed():
    inline = feedback_html.tex_to_mathml(r"I = F / B")
    assert inline.startswith('<math display="inline">') and "<mi>I</mi>" in inline
    assert "xmlns" not in inline and "http" not in inline
    assert feedback_html.tex_to_mathml(r"\frac{a}{b}", display=True).startswith('<math display="block">')


@pytest.mark.parametrize("tex", [r"\text{<img src=x onerror=alert(1)>}", r"\text{<b>bold</b>}",
                                 r"\frac{1}{", "<script>alert(1)</script>"])
def test_hostile_or_broken_tex_shows_as_escaped_source(tex):
    out = feedback_html.tex_to_mathml(tex)
    assert "<img" not in out and "<b>" not in out and "<script" not in out
    parsed = _Tags()
    parsed.feed(out)
    assert {tag for tag, _ in parsed.tags} <= feedback_html.MATHML_ELEMENTS | {"code"}


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


# Attributes through which a page makes the browser fetch something by itself.
LOADING = {"src", "href", "srcset", "data", "poster", "background", "action", "formaction"}


@pytest.fixture(scope="module")
def feedback_page(tmp_path_factory):
    """Lab 00's source notebook rendered by the exporter and template the course config names,
    as nbgrader's generate_feedback sets them up (GetGrades' scores filled in by hand)."""
    from nbgrader.converters import GenerateFeedback

    course = Course(tmp_path_factory.mktemp("course"))
    write_config(course)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(course.root)).load_config()
    converter = GenerateFeedback(config=config)
    exporter = converter.exporter_class(parent=converter, config=converter.config)
    assert isinstance(exporter, feedback_html.OfflineFeedbackExporter)
    nb = to_nbgrader_notebook(Path(lab_sources()["00_measure"]))
    for cell in nb.cells:
        if "nbgrader" in cell.metadata:
            cell.metadata.nbgrader.update(score=0, points=1)
    resources = {"nbgrader": {"notebook": "00_measure", "score": 0, "max_score": 1, "late_penalty": 0}}
    page, _ = exporter.from_notebook_node(nb, resources=resources)
    return page


def test_feedback_page_loads_nothing_from_the_network(feedback_page):
    parsed = _Tags()
    parsed.feed(feedback_page)
    remote = [(tag, name, value) for tag, attrs in parsed.tags for name, value in attrs.items()
              if name in LOADING and value and value.strip().lower().startswith(("http:", "https:", "//"))]
    assert remote == []
    # No MathJax, nor any other script: this notebook has no output that carries one.
    assert [attrs for tag, attrs in parsed.tags if tag == "script"] == []
    policy = [attrs["content"] for tag, attrs in parsed.tags
              if tag == "meta" and attrs.get("http-equiv", "").lower() == "content-security-policy"]
    assert policy and policy[0].startswith("default-src 'none'")


def test_feedback_page_shows_lab_math_as_mathml(feedback_page):
    assert feedback_page.count("<math") > 10
    assert "$I = F / B$" not in feedback_page and "tex-source" not in feedback_page
