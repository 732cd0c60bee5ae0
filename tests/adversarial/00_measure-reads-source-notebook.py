# expect: roofline=error
# Reading the answers: looks for the instructor's notebooks anywhere on the filesystem.
# %% grade_id=roofline_code
import json
import os

_found = None
for _root, _dirs, _files in os.walk("/"):
    if _root.startswith(("/proc", "/sys", "/dev", "/usr")):
        _dirs[:] = []
        continue
    for _f in _files:
        if _f in ("00_measure.ipynb", "00_measure.py"):
            _text = open(os.path.join(_root, _f), errors="ignore").read()
            if "BEGIN SOLUTION" in _text:
                _found = _text
if _found is None:
    raise RuntimeError("no solutions visible")
exec(_found)
