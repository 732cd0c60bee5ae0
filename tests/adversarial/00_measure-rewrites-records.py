# expect: roofline=error
# Writing outside the sandbox: overwrites the course's records and gradebook wherever it finds them.
# (The test plants canaries named fastdl-adversarial-canary.* beside them; only those are targeted.)
# %% grade_id=roofline_code
import os

_hits = []
for _target in ("/tmp/fastdl-adversarial-pwned", "/work/fastdl-adversarial-pwned"):
    try:
        open(_target, "w").write("pwned")
        _hits.append(_target)
    except OSError:
        pass
for _root, _dirs, _files in os.walk("/"):
    if _root.startswith(("/proc", "/sys", "/dev", "/usr")):
        _dirs[:] = []
        continue
    for _f in _files:
        if _f.startswith("fastdl-adversarial-canary"):
            try:
                open(os.path.join(_root, _f), "w").write("pwned")
                _hits.append(_f)
            except OSError:
                pass
raise RuntimeError(f"rewrote {_hits}")
