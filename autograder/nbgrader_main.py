"""``python -m autograder.nbgrader_main ARGS`` is ``python -m nbgrader ARGS`` started without the
imports ``autograder.startup`` skips: how the grader runs every nbgrader command."""

from autograder.startup import skip_unused_imports

skip_unused_imports()

from nbgrader.apps.nbgraderapp import main  # noqa: E402 - after the skip, which must come first

main()
