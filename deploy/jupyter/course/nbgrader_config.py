# Read by every account of the course hub (students, instructors and the formgrader service), which
# finds it through JUPYTER_CONFIG_PATH (deploy/jupyterhub_config.py sets it): one course, one exchange.
import os

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.CourseDirectory.course_id = "fastdl-lab"
c.Exchange.root = os.environ.get("FASTDL_EXCHANGE", "/srv/nbgrader/exchange")
