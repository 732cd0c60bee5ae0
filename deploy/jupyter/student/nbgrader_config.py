# A student's submissions are filed under their hub name. nbgrader would otherwise take the name of
# the Unix account, which is the same for everyone when one account runs every server (make hub).
import os

c = get_config()  # noqa: F821
if os.environ.get("JUPYTERHUB_USER"):
    c.CourseDirectory.student_id = os.environ["JUPYTERHUB_USER"]
