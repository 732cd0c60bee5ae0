# expect: grouped_order=error
# Writing outside the sandbox: plants a lab spec that a later trusted `autograde` would import.
# %% grade_id=grouped_order_code
import os

import autograder.labs

_planted = []
for _dir in autograder.labs.__path__:
    try:
        with open(os.path.join(_dir, "lab99_planted.py"), "w") as _f:
            _f.write("import os\nos.system('touch /tmp/fastdl-adversarial-pwned')\n")
        _planted.append(_dir)
    except OSError:
        pass
raise RuntimeError(f"planted in {_planted}")
