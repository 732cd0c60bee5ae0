"""Feedback pages that load nothing from anywhere: math as MathML, and a policy that forbids loads.

nbgrader's feedback template asks a CDN for MathJax (its ``mathjax()`` call takes the macro's own
URL, so ``HTMLExporter.mathjax_url`` does not reach it): offline a student sees raw ``$...$``, and
online every student's browser calls a third party. The equations are turned into MathML here,
once, when the instructor makes the feedback, rather than by a bundled MathJax, because:

- a feedback page travels alone. ``release_feedback`` copies each HTML file into the exchange and
  ``fetch_feedback`` copies it into the student's folder, so a script folder beside it never
  arrives, and inlining MathJax would copy a whole TeX engine into every file of every student for
  every lab;
- browsers draw MathML Core themselves (Chromium, Firefox, Safari), with no script at all, so the
  math shows from the file system, in the student's JupyterLab (whose HTML viewer runs no script
  until the file is trusted) and on paper.

The page also carries a Content-Security-Policy that lets it load nothing but inline styles and
``data:`` images (``templates/feedback_offline/mathjax.html.j2``): a student's own output that
points at a remote image or script stays inert, whatever the notebook holds.
"""

from __future__ import annotations

import html
from pathlib import Path
from xml.etree import ElementTree

import latex2mathml.converter
import nbgrader
from jinja2 import pass_context
from nbconvert.exporters import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

TEMPLATES = Path(__file__).resolve().parent / "templates"
TEMPLATE_NAME = "feedback_offline"
# nbgrader's feedback template, which ours builds on (nbgrader/converters/generate_feedback.py
# points the exporter at the same folder).
NBGRADER_TEMPLATES = Path(nbgrader.__file__).resolve().parent / "server_extensions" / "formgrader" / "templates"

# The MathML the converter may hand back; anything else (an element typed inside \text{...}, say)
# shows the equation's TeX as text instead. Every element of MathML Core but <maction> and links.
MATHML_ELEMENTS = frozenset(
    "math mrow mi mn mo ms mtext mspace msub msup msubsup munder mover munderover mfrac msqrt mroot "
    "mstyle mpadded mphantom menclose merror mtable mtr mtd mlabeledtr mmultiscripts mprescripts none "
    "semantics annotation".split())
# Presentation attributes only: none names a URL or an event handler.
MATHML_ATTRIBUTES = frozenset(
    "display displaystyle scriptlevel mathvariant mathsize mathcolor mathbackground stretchy fence "
    "separator symmetric largeop movablelimits accent accentunder form lspace rspace minsize maxsize "
    "width height depth voffset linebreak linethickness bevelled notation align rowalign columnalign "
    "columnspacing rowspacing columnlines rowlines frame framespacing columnspan rowspan encoding".split())


class UnsafeMathML(ValueError):
    pass


def tex_to_mathml(tex: str, display: bool = False) -> str:
    """``tex`` (the inside of ``$...$``) as a ``<math>`` element; where the converter fails or
    answers with something other than plain MathML, the TeX itself, escaped, as code."""
    try:
        tree = ElementTree.fromstring(latex2mathml.converter.convert(tex, display="block" if display else "inline"))
        _keep_mathml_only(tree)
    except Exception:  # noqa: BLE001 - the converter raises many kinds; every one means "show the source"
        delimiter = "$$" if display else "$"
        return f'<code class="tex-source">{html.escape(delimiter + tex + delimiter)}</code>'
    # Serialised again from the checked tree, so every text is escaped whatever the converter did.
    return ElementTree.tostring(tree, encoding="unicode", short_empty_elements=False)


def _keep_mathml_only(tree: ElementTree.Element) -> None:
    for element in tree.iter():
        # HTML puts <math> in the MathML namespace by itself: no xmlns (and so no URL) in the page.
        element.tag = element.tag.rpartition("}")[2]
        if element.tag not in MATHML_ELEMENTS:
            raise UnsafeMathML(element.tag)
        for name in [n for n in element.attrib if n not in MATHML_ATTRIBUTES]:
            del element.attrib[name]


class MathMLRenderer(IPythonRenderer):
    """nbconvert's Markdown renderer with every equation it finds written as MathML. nbconvert's
    parser decides what is math (``$..$``, ``$$..$$``, ``\\(..\\)``, ``\\[..\\]``, environments),
    so a dollar sign in code or an escaped ``\\$`` stays as it was."""

    def inline_math(self, body: str) -> str:
        return tex_to_mathml(body, display=False)

    def block_math(self, body: str) -> str:
        return tex_to_mathml(body, display=True)

    def latex_environment(self, name: str, body: str) -> str:
        return tex_to_mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)


class OfflineFeedbackExporter(HTMLExporter):
    """nbgrader's feedback page with MathML for math (the course config names it as
    ``GenerateFeedback.exporter_class``, with the template ``feedback_offline``)."""

    @pass_context
    def markdown2html(self, context, source):
        # HTMLExporter.markdown2html with this module's renderer, given the same settings.
        cell = context.get("cell", {})
        renderer = MathMLRenderer(
            escape=False,
            attachments=cell.get("attachments", {}),
            embed_images=self.embed_images,
            path=context.get("resources", {}).get("metadata", {}).get("path", ""),
            anchor_link_text=self.anchor_link_text,
            exclude_anchor_links=self.exclude_anchor_links,
            **self.lexer_options,
        )
        return MarkdownWithMath(renderer=renderer).render(source)
