# Read by every account of the course hub (students, instructors and the formgrader service), which
# finds it through JUPYTER_CONFIG_PATH (deploy/jupyterhub_config.py sets it): one course, one exchange.
import os

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.CourseDirectory.course_id = "fastdl-lab"
c.Exchange.root = os.environ.get("FASTDL_EXCHANGE", "/srv/nbgrader/exchange")

# nbgrader's collect compares a submission's Unix owner with the student it is filed under. Where
# one account runs every server (the trial hub) the owner is always that account: the comparison
# tells nothing and would flag every honest submission, so it is off there. Where each user has a
# uid of their own (the course image's accounts, the production hub's roster uids) it stays on,
# and a warning means a folder filed under another student's name.
if os.environ.get("FASTDL_ONE_ACCOUNT") == "1":
    c.ExchangeCollect.check_owner = False
