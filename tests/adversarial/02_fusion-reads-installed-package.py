# expect: conv_bn_fold=error
# Reading the answers: asks the installed distribution where its files are.
# %% grade_id=fold_code
import importlib.metadata
import os

_files = importlib.metadata.distribution("fastdl-lab").files or []
_text = None
for _f in _files:
    _path = str(_f.locate())
    if _path.endswith(".pth"):
        for _line in open(_path).read().split():
            _candidate = os.path.join(_line, "fastdl_lab", "fusion.py")
            if os.path.exists(_candidate):
                _text = open(_candidate).read()
if _text is None or "part of a graded exercise" in _text:
    raise RuntimeError("only the student copy is visible")
_ns = {}
exec(_text, _ns)
fold_conv_bn = _ns["fold_conv_bn_ref"]
