"""``python -m autograder.nbgrader_main ARGS`` is ``python -m nbgrader ARGS`` started without the
imports ``autograder.startup`` skips: how the grader runs every nbgrader command.

Importing it runs nothing: nbgrader's warm fork server (``engine/prefork.py``) imports it once, and
each run it forks executes it as ``__main__``."""

from autograder.startup import skip_unused_imports

skip_unused_imports()

from nbgrader.apps.nbgraderapp import main  # noqa: E402 - after the skip, which must come first

if __name__ == "__main__":
    main()
