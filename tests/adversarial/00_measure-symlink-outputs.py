# expect: roofline=failed
# Stopping the batch: the outputs file is a link to something else on the machine.
# %% grade_id=roofline_code
import os

os.symlink("/etc/passwd", "/job/outputs.pt")
os._exit(0)
