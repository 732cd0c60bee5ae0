# JupyterHub for the fastdl-lab course: students, instructors, nbgrader's exchange and a formgrader.
#
# Two modes, chosen by FASTDL_HUB_MODE:
#   course (default, the image built by deploy/Dockerfile): every user is a Unix account (PAM login,
#       LocalProcessSpawner), so file permissions keep students out of the instructors' files: the
#       full package and the course folder are readable by the instructors' Unix group only.
#   trial (`make hub`, the end-to-end test): one machine, no accounts to create. Every server runs
#       as whoever started the hub (SimpleLocalProcessSpawner), each in its own home folder, and a
#       printed password lets anyone on the roster in. A student's Python sees the student package
#       first, but nothing but convention keeps them out of the repository: try the course with it,
#       never teach with it.
#
# nbgrader's conventions are kept, so that its JupyterHub plugin could be switched on later: the
# formgrader service is named after the course, instructors are in formgrade-<course>, students in
# nbgrader-<course>. Paths and rosters come from FASTDL_* variables (defaults: the image's layout).
import os
import sys
from pathlib import Path

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)

HERE = Path(__file__).resolve().parent
COURSE_ID = "fastdl-lab"
INSTRUCTORS = f"formgrade-{COURSE_ID}"
STUDENTS = f"nbgrader-{COURSE_ID}"


def setting(name: str, default: str) -> str:
    return os.environ.get(name) or default


def roster(name: str, default: str) -> list[str]:
    return [n.strip() for n in setting(name, default).split(",") if n.strip()]


trial = setting("FASTDL_HUB_MODE", "course") == "trial"
if setting("FASTDL_HUB_MODE", "course") not in ("course", "trial"):
    raise ValueError(f"FASTDL_HUB_MODE must be 'course' or 'trial', not {os.environ['FASTDL_HUB_MODE']!r}")

state = Path(setting("FASTDL_HUB_STATE", "/srv/fastdl/hub"))
exchange = setting("FASTDL_EXCHANGE", "/srv/nbgrader/exchange")
course_dir = setting("FASTDL_COURSE_DIR", "/srv/fastdl/course")
# The student copy of the package (solutions stubbed) and the full one, each a folder put first on
# the servers' PYTHONPATH by role; the image's environment holds neither (deploy/Dockerfile).
student_package = setting("FASTDL_STUDENT_PACKAGE", "/opt/fastdl/student")
instructor_package = setting("FASTDL_INSTRUCTOR_PACKAGE", "/opt/fastdl/instructor")
python_bin = Path(setting("FASTDL_PYTHON_BIN", str(Path(sys.executable).parent)))
# Every role's Jupyter and nbgrader settings (deploy/jupyter): the image keeps a copy everyone can
# read, since its copy of deploy/ lies in the instructors' part.
settings_dir = Path(setting("FASTDL_JUPYTER_SETTINGS", str(HERE / "jupyter")))
instructors = roster("FASTDL_INSTRUCTORS", "instructor")
students = roster("FASTDL_STUDENTS", "")
overlap = set(instructors) & set(students)
if overlap:
    raise ValueError(f"on both rosters (instructor and student): {sorted(overlap)}")

c.JupyterHub.bind_url = f"http://{setting('FASTDL_HUB_IP', '127.0.0.1' if trial else '0.0.0.0')}:{setting('FASTDL_HUB_PORT', '8000')}/"
c.JupyterHub.hub_bind_url = f"http://127.0.0.1:{setting('FASTDL_HUB_API_PORT', '8081')}"
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{setting('FASTDL_PROXY_API_PORT', '8001')}"
c.ConfigurableHTTPProxy.command = [setting("FASTDL_PROXY", "configurable-http-proxy")]
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "cookie_secret")
c.JupyterHub.pid_file = str(state / "jupyterhub.pid")

c.Authenticator.allowed_users = set(instructors) | set(students)
if trial:
    c.JupyterHub.authenticator_class = "dummy"
    c.DummyAuthenticator.password = os.environ["FASTDL_HUB_PASSWORD"]
    c.JupyterHub.spawner_class = "simple"
    c.SimpleLocalProcessSpawner.home_dir_template = str(state / "home" / "{username}")
# else: PAM and LocalProcessSpawner, JupyterHub's defaults, over the accounts the image creates.

c.JupyterHub.load_groups = {INSTRUCTORS: {"users": instructors}, STUDENTS: {"users": students}}
c.JupyterHub.load_roles = [
    {"name": "course-instructor", "groups": [INSTRUCTORS], "scopes": [f"access:services!service={COURSE_ID}"]},
]

# A single-user server starts JupyterLab and imports torch in its kernels: on a busy machine that
# takes longer than JupyterHub's 30 s default.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180
c.Spawner.cmd = [str(python_bin / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab"
# Trial mode started by root (a container, a development machine) runs the servers as root too.
root_servers = ["--allow-root"] if trial and os.geteuid() == 0 else []
c.Spawner.args = root_servers
# Nothing of the hub's own environment reaches a server but what role_environment gives it.
c.Spawner.env_keep = ["LANG", "LC_ALL"]


def base_environment(role: str) -> dict[str, str]:
    """What every server of ``role`` (student, instructor, grader) needs: the course's Python first
    on PATH (nbgrader calls `alembic` by name), the role's Jupyter and nbgrader settings, the exchange."""
    config_path = os.pathsep.join([str(settings_dir / role), str(settings_dir / "course")])
    return {
        "PATH": os.pathsep.join([str(python_bin), "/usr/local/bin", "/usr/bin", "/bin"]),
        "JUPYTER_CONFIG_PATH": config_path,
        "FASTDL_EXCHANGE": exchange,
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


def role_environment(role: str) -> dict[str, str]:
    env = base_environment(role)
    if trial:
        # One account runs every server: nbgrader's collect would find each submission owned by
        # it, not by the student named, and warn of cheating for every one (course/nbgrader_config.py).
        env["FASTDL_ONE_ACCOUNT"] = "1"
    if role == "student":
        env["PYTHONPATH"] = student_package
    else:
        env["PYTHONPATH"] = instructor_package
        env["FASTDL_COURSE_DIR"] = course_dir
    return env


def role_of(groups: set[str]) -> str:
    if INSTRUCTORS in groups:
        return "instructor"
    if STUDENTS in groups:
        return "student"
    raise PermissionError(f"not on the {COURSE_ID} roster (in neither {INSTRUCTORS} nor {STUDENTS})")


def pre_spawn_hook(spawner):
    spawner.environment.update(role_environment(role_of({g.name for g in spawner.user.groups})))


c.Spawner.pre_spawn_hook = pre_spawn_hook

# The formgrader runs as a service of the hub in the course folder (nbgrader's pattern for a course
# with several graders): instructors reach it at /services/fastdl-lab/ and share one gradebook. In
# the image it runs as its own account, which with the instructors owns the course folder and can
# start the grading sandbox (bubblewrap).
service = {
    "name": COURSE_ID,
    "url": f"http://127.0.0.1:{setting('FASTDL_FORMGRADER_PORT', '9999')}",
    "command": [str(python_bin / "jupyterhub-singleuser"), f"--ServerApp.root_dir={course_dir}", *root_servers],
    "cwd": course_dir,
    "environment": {**role_environment("grader"), "JUPYTERHUB_DEFAULT_URL": "/formgrader"},
    "oauth_no_confirm": True,
}
if trial:
    # Its Jupyter runtime files and caches go to a home of its own, as in course mode.
    service["environment"]["HOME"] = str(state / "home" / f"grader-{COURSE_ID}")
else:
    service["user"] = setting("FASTDL_GRADER_ACCOUNT", f"grader-{COURSE_ID}")
c.JupyterHub.services = [service]
