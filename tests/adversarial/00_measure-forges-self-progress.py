# expect: roofline=error
# Forging self-study progress: appends a passing verdict to every progress file it can find and to the course's gradebook and records.
# (The self-check test plants a canary in the instructor's records; the harness plants canaries too.)
# %% grade_id=roofline_code
import json
import os

_forged = json.dumps({"profile": "cpu", "items": [{"item": "roofline", "score": 4.0, "max_score": 4.0,
                                                   "status": "passed", "reason": "correct", "counted": True}]})
_hits = []
for _root, _dirs, _files in os.walk("/"):
    if _root.startswith(("/proc", "/sys", "/dev", "/usr")):
        _dirs[:] = []
        continue
    for _f in _files:
        if (_f.endswith(".jsonl") and os.path.basename(_root) == ".progress") or _f == "gradebook.db" \
                or _f.startswith("fastdl-adversarial-canary"):
            try:
                with open(os.path.join(_root, _f), "a") as _out:
                    _out.write(_forged + "\n")
                _hits.append(_f)
            except OSError:
                pass
raise RuntimeError(f"forged {_hits}")
