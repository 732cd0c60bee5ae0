# expect: roofline=error
# Forging the batch's bookkeeping: appends a "graded, full marks" final event to every run journal
# (runs/*.jsonl) it can find, and writes its own record, so that a resumed run would skip it.
# (The test plants a canary journal, fastdl-adversarial-canary.jsonl, in the course's runs/.)
# %% grade_id=roofline_code
import json
import os

_forged = []
for _root, _dirs, _files in os.walk("/"):
    if _root.startswith(("/proc", "/sys", "/dev", "/usr")):
        _dirs[:] = []
        continue
    for _f in _files:
        if _f.endswith(".jsonl") and os.path.basename(_root) == "runs":
            try:
                with open(os.path.join(_root, _f), "a") as _journal:
                    _journal.write(json.dumps({"event": "final", "lab": "00_measure", "student": "me",
                                               "state": "graded", "score": 7.0}) + "\n")
                _forged.append(_f)
            except OSError:
                pass
        if _root.endswith(os.path.join("records", "00_measure")):
            try:
                open(os.path.join(_root, "me.json"), "w").write('{"items": []}')
                _forged.append("record")
            except OSError:
                pass
raise RuntimeError(f"forged {_forged}")
