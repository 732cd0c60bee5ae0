"""What the long steps of ``make test-e2e`` usually take, measured there on the 2-core machine.

Their progress lines (``progress_lines.Lines``) say these while the steps run; the README states
the same figures, and tests/test_readme_times.py holds the two together.
"""

COURSE_BUILD = "about 30 s on the 2-core machine"
DEMO_CLASS = "about 3 minutes on the 2-core machine"
HUB_TERM = "about 50 s on the 2-core machine"
