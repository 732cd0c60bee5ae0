"""fastdl-lab: the helper package of the efficient deep learning systems course.

One module per technique (see the course map in README.md), plus three shared modules that every
lab, test, benchmark and the grader use: ``device`` (what hardware is here), ``timing`` (the one
timing harness) and ``checks`` (the one correctness harness).

Importing the package stays light: it imports no Triton and no technique module.
"""

__version__ = "0.1.0"
