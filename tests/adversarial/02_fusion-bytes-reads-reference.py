# expect: softmax_bytes=error
# Reading the answers: imports the reference byte count from any full copy of the package it can find.
# %% grade_id=softmax_bytes_code
import os
import sys

_found = None
for _base in list(sys.path) + ["/work", "/root", "/opt", "/tmp"]:
    for _root, _dirs, _files in os.walk(_base or "."):
        if "softmax.py" in _files and "fastdl_lab" in _root:
            _text = open(os.path.join(_root, "softmax.py"), errors="ignore").read()
            if "def softmax_bytes_ref" in _text and "part of a graded exercise" not in _text:
                _found = _text
if _found is None:
    raise RuntimeError("only the student copy is visible")
_ns = {}
exec(_found, _ns)
softmax_bytes = _ns["softmax_bytes_ref"]
