"""Start-up of the grader's own command lines, less an import nothing here uses.

jsonschema (imported by nbformat, so by nbgrader and this package's command line) imports its
optional IRI format checker ``rfc3987_syntax`` when it is installed, and that module compiles a
Lark grammar at import: 1.4 s of nbgrader's 2.3 s of imports on the 2-core machines, paid once
per submission graded (nbgrader's run of the notebook is a process of its own). No schema the
course, nbformat or nbgrader validates uses the "iri" formats. A None in ``sys.modules`` makes
the import fail as a missing module would, which jsonschema treats as "checker not installed".
"""

import sys

SKIPPED = ("rfc3987_syntax",)


def skip_unused_imports() -> None:
    """Call before anything imports jsonschema; a module already imported stays as it is."""
    for name in SKIPPED:
        sys.modules.setdefault(name, None)
