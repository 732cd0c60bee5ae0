# The formgrader service works in the course folder that `python -m autograder build` made; that
# folder's own nbgrader_config.py (read from the working directory) holds the gradebook and the
# trusted engine's preprocessors.
import os

c = get_config()  # noqa: F821
c.CourseDirectory.root = os.environ.get("FASTDL_COURSE_DIR", "/srv/fastdl/course")
