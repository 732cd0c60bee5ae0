from autograder.startup import skip_unused_imports

skip_unused_imports()

from autograder.cli import main  # noqa: E402 - after the skip, which must come first

raise SystemExit(main())
