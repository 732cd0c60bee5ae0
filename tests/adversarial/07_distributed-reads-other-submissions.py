# expect: ring_allreduce=rejected
# Reading the answers: copies another student's ring from the submissions folder.
# %% grade_id=ring_code
import json
import os

_theirs = None
for _root, _dirs, _files in os.walk("/"):
    if _root.startswith(("/proc", "/sys", "/dev", "/usr")):
        _dirs[:] = []
        continue
    for _f in _files:
        if _f == "07_distributed.ipynb" and "submitted" in _root:
            for _cell in json.load(open(os.path.join(_root, _f)))["cells"]:
                if _cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "ring_code":
                    _theirs = "".join(_cell["source"])
if _theirs is None:
    raise RuntimeError("no other submission visible")
exec(_theirs)
