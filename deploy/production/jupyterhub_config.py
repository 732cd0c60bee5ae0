# The course's JupyterHub for a class: each student's server in a container of its own, with
# limits, a home volume and a GPU request; a single sign-on login; TLS; an idle culler; nbgrader's
# exchange on a shared volume; the formgrader and the grading on containers students never reach.
#
# FASTDL_SPAWNER chooses how servers start:
#   docker      DockerSpawner on one host (docker-compose.yml beside this file): this file is the
#               hub's whole configuration.
#   kubernetes  KubeSpawner through the zero-to-jupyterhub Helm chart (z2jh-values.yaml): the chart
#               configures the hub's network, proxy, TLS and culler; this file adds the course.
# The trial hub (`make hub`, deploy/jupyterhub_config.py) is another file: nothing here changes it.
#
# Who may log in comes from the roster file `python -m autograder roster import roster.csv --hub FILE`
# writes (FASTDL_ROSTER); each user's server runs as the uid that file gives them, so that the
# grading side, which maps the same uids to names, can tell who wrote each submission.
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import limits  # noqa: E402 (the numbers, shared with the Helm values)

c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)

COURSE_ID = "fastdl-lab"
INSTRUCTORS = f"formgrade-{COURSE_ID}"
STUDENTS = f"nbgrader-{COURSE_ID}"
# Paths inside a student's container (deploy/production/Dockerfile.student).
HOME = "/home/student"
EXCHANGE = "/srv/nbgrader/exchange"
SETTINGS = "/opt/fastdl/jupyter"


def setting(name: str, default: str | None = None) -> str:
    value = os.environ.get(name) or default
    if value is None:
        raise ValueError(f"{name} is not set (README, \"Teaching a class: the production hub\", says what it holds)")
    return value


def choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = setting(name, default)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
    return value


spawner_kind = choice("FASTDL_SPAWNER", "docker", ("docker", "kubernetes"))
roster_file = Path(setting("FASTDL_ROSTER", "/srv/fastdl/roster/roster.json"))
if not roster_file.is_file():
    raise FileNotFoundError(f"no roster at {roster_file}: python -m autograder roster import roster.csv --hub {roster_file}")
roster = json.loads(roster_file.read_text())
c.JupyterHub.public_url = setting("FASTDL_PUBLIC_URL")

# --- who: the roster, its two groups, and the instructors' way into the formgrader ---------------
c.Authenticator.allowed_users = set(roster["instructors"]) | set(roster["students"])
c.JupyterHub.load_groups = {INSTRUCTORS: {"users": roster["instructors"]}, STUDENTS: {"users": roster["students"]}}


def add(name: str, *items: dict) -> None:
    """Append to one of the hub's lists: under the Helm chart this file runs after the chart's own
    configuration, whose services and roles (its culler's) must stay."""
    c.JupyterHub[name] = [*(c.JupyterHub[name] if name in c.JupyterHub else []), *items]


add("load_roles", {"name": "course-instructor", "groups": [INSTRUCTORS],
                   "scopes": [f"access:services!service={COURSE_ID}"]})

# --- login: the institution's single sign-on; never passwords kept by the hub ---------------------
auth = choice("FASTDL_AUTH", "oauth", ("oauth", "lti13"))
if auth == "oauth":
    # Any OpenID Connect provider (Keycloak, Azure AD, Google Workspace, a university's Shibboleth
    # bridge): the roster's ids must be what the provider sends in FASTDL_OAUTH_USERNAME_CLAIM.
    c.JupyterHub.authenticator_class = "generic-oauth"
    c.GenericOAuthenticator.client_id = setting("FASTDL_OAUTH_CLIENT_ID")
    c.GenericOAuthenticator.client_secret = setting("FASTDL_OAUTH_CLIENT_SECRET")
    c.GenericOAuthenticator.oauth_callback_url = f"{setting('FASTDL_PUBLIC_URL').rstrip('/')}/hub/oauth_callback"
    c.GenericOAuthenticator.authorize_url = setting("FASTDL_OAUTH_AUTHORIZE_URL")
    c.GenericOAuthenticator.token_url = setting("FASTDL_OAUTH_TOKEN_URL")
    c.GenericOAuthenticator.userdata_url = setting("FASTDL_OAUTH_USERDATA_URL")
    c.GenericOAuthenticator.scope = ["openid", "profile", "email"]
    c.GenericOAuthenticator.username_claim = setting("FASTDL_OAUTH_USERNAME_CLAIM", "preferred_username")
else:
    # LTI 1.3 from the course's LMS (Canvas, Moodle, Blackboard): students arrive from the course
    # page. The hub is registered in the LMS as a tool; these are the LMS's endpoints for it.
    c.JupyterHub.authenticator_class = "ltiauthenticator.lti13.auth.LTI13Authenticator"
    c.LTI13Authenticator.issuer = setting("FASTDL_LTI_ISSUER")
    c.LTI13Authenticator.authorize_url = setting("FASTDL_LTI_AUTHORIZE_URL")
    c.LTI13Authenticator.jwks_endpoint = setting("FASTDL_LTI_JWKS_URL")
    c.LTI13Authenticator.client_id = [setting("FASTDL_LTI_CLIENT_ID")]
    # The claim the roster's ids are: an LMS login name is stable and unique within the institution.
    c.LTI13Authenticator.username_key = setting("FASTDL_LTI_USERNAME_CLAIM", "email")


# --- each user's server ---------------------------------------------------------------------------
def uid_of(spawner) -> int:
    """The roster's uid for this user: the owner of every file their server writes."""
    return roster["uids"][spawner.user.name]


def role_environment(spawner) -> dict[str, str]:
    """What a server needs beyond the image: the role's Jupyter and nbgrader settings, the student
    package first on the path, and a name for tools that ask the system who they run as."""
    role = "instructor" if INSTRUCTORS in {g.name for g in spawner.user.groups} else "student"
    return {
        "JUPYTER_CONFIG_PATH": os.pathsep.join([f"{SETTINGS}/{role}", f"{SETTINGS}/course"]),
        "PYTHONPATH": "/opt/fastdl/student",
        "FASTDL_EXCHANGE": EXCHANGE,
        "HOME": HOME,
        "USER": spawner.user.name,
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    }


# Every server, an instructor's included, runs the student image: the solutions, the hidden tests
# and the gradebook exist only in the grading image (deploy/Dockerfile), which serves instructors
# through the formgrader service.
c.Spawner.default_url = "/lab"
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.Spawner.start_timeout = 300  # a new node may first pull the image
c.Spawner.http_timeout = 180
c.Spawner.mem_limit = limits.MEM_LIMIT
c.Spawner.mem_guarantee = limits.MEM_GUARANTEE
c.Spawner.cpu_limit = limits.CPU_LIMIT
c.Spawner.cpu_guarantee = limits.CPU_GUARANTEE
student_image = setting("FASTDL_STUDENT_IMAGE", "fastdl-lab-student:latest")

if spawner_kind == "docker":
    from docker.types import DeviceRequest

    c.JupyterHub.spawner_class = "docker"
    c.DockerSpawner.image = student_image
    # Students' servers share a network with the hub and the formgrader only: the Dask scheduler
    # and its workers sit on another (docker-compose.yml), out of a student's reach.
    c.DockerSpawner.network_name = setting("FASTDL_DOCKER_NETWORK", "fastdl-hub")
    c.DockerSpawner.use_internal_ip = True
    c.DockerSpawner.remove = True  # a stopped server's container goes; its home volume stays
    c.DockerSpawner.notebook_dir = HOME
    c.DockerSpawner.volumes = {
        "fastdl-home-{username}": HOME,
        setting("FASTDL_EXCHANGE_VOLUME", "fastdl-exchange"): EXCHANGE,
    }
    gpus = [d for d in setting("FASTDL_GPU_DEVICES", "").split(",") if d]

    def pre_spawn_hook(spawner):
        uid = uid_of(spawner)
        spawner.environment.update(role_environment(spawner))
        spawner.extra_create_kwargs = {"user": f"{uid}:{roster['gid']}"}
        if gpus:
            # One GPU server: a user always lands on the same device (or MIG instance, by its UUID),
            # the users sharing it share its memory.
            spawner.extra_host_config = {
                "device_requests": [DeviceRequest(device_ids=[gpus[uid % len(gpus)]], capabilities=[["gpu"]])]}

    c.DockerSpawner.pre_spawn_hook = pre_spawn_hook

    # The hub's own network, state and TLS: on Kubernetes the chart sets these.
    state = Path(setting("FASTDL_HUB_STATE", "/srv/jupyterhub"))
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "cookie_secret")
    c.JupyterHub.hub_bind_url = "http://0.0.0.0:8081"
    c.JupyterHub.hub_connect_url = f"http://{setting('FASTDL_HUB_HOST', 'hub')}:8081"
    cert, key = os.environ.get("FASTDL_SSL_CERT"), os.environ.get("FASTDL_SSL_KEY")
    if cert and key:
        c.JupyterHub.bind_url = "https://0.0.0.0:443/"
        c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = cert, key
    elif os.environ.get("FASTDL_TLS_UPSTREAM") == "1":
        # A reverse proxy in front (nginx, Traefik, the institution's load balancer) ends TLS and
        # forwards to this port; nothing else may reach it.
        c.JupyterHub.bind_url = "http://0.0.0.0:8000/"
    else:
        raise ValueError("no TLS: set FASTDL_SSL_CERT and FASTDL_SSL_KEY, or FASTDL_TLS_UPSTREAM=1 when a "
                         "reverse proxy in front of the hub ends TLS (logins and tokens must not cross the "
                         "network in clear)")

    # The idle culler, as a service of the hub with only the rights it needs. On Kubernetes the
    # chart runs the same program (z2jh-values.yaml, cull:).
    add("services", {
        "name": "idle-culler",
        "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={limits.CULL_TIMEOUT_S}",
                    f"--cull-every={limits.CULL_EVERY_S}"],
    })
    add("load_roles", {"name": "idle-culler", "services": ["idle-culler"],
                       "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]})
else:
    c.JupyterHub.spawner_class = "kubespawner.KubeSpawner"
    c.KubeSpawner.image = student_image
    c.KubeSpawner.uid = uid_of
    c.KubeSpawner.gid = roster["gid"]
    # The home volume is made group-owned by this gid on first mount, so any uid of the course can
    # write its own.
    c.KubeSpawner.fs_gid = roster["gid"]
    c.KubeSpawner.working_dir = HOME
    c.KubeSpawner.pvc_name_template = "fastdl-home-{username}"
    c.KubeSpawner.storage_pvc_ensure = True
    c.KubeSpawner.storage_capacity = limits.HOME_CAPACITY
    exchange_claim = setting("FASTDL_EXCHANGE_CLAIM", "fastdl-exchange")  # ReadWriteMany (NFS, CephFS)
    c.KubeSpawner.volumes = [
        {"name": "home", "persistentVolumeClaim": {"claimName": "fastdl-home-{username}"}},
        {"name": "exchange", "persistentVolumeClaim": {"claimName": exchange_claim}},
    ]
    c.KubeSpawner.volume_mounts = [{"name": "home", "mountPath": HOME}, {"name": "exchange", "mountPath": EXCHANGE}]
    gpu_resource = setting("FASTDL_GPU_RESOURCE", "nvidia.com/gpu")
    # Every lab runs on the CPU (Triton's interpreter), so the CPU server is the default and a GPU
    # node is held only by a student who asks for one, for the labs' speed measurements.
    c.KubeSpawner.profile_list = [
        {"display_name": "CPU", "slug": "cpu", "default": True,
         "description": "every lab, kernels under Triton's interpreter"},
        {"display_name": "GPU", "slug": "gpu",
         "description": f"one {gpu_resource}: real kernel launches and speed measurements",
         "kubespawner_override": {"extra_resource_limits": {gpu_resource: str(limits.GPU_COUNT)}}},
    ]

    def pre_spawn_hook(spawner):
        spawner.environment.update(role_environment(spawner))

    c.KubeSpawner.pre_spawn_hook = pre_spawn_hook

# --- the formgrader: a service of the hub that runs in the grading image ---------------------------
# The hub only routes /services/fastdl-lab/ to it and logs instructors in; the formgrader container
# (start-grader.sh) holds the course folder, the gradebook and the solutions, and starts grading on
# the Dask cluster beside it. Students' servers cannot reach the cluster.
add("services", {
    "name": COURSE_ID,
    "url": setting("FASTDL_FORMGRADER_URL", "http://formgrader:9999"),
    "api_token": setting("FASTDL_FORMGRADER_TOKEN"),
    "oauth_no_confirm": True,
    "oauth_client_id": f"service-{COURSE_ID}",
    "oauth_redirect_uri": f"{setting('FASTDL_PUBLIC_URL').rstrip('/')}/services/{COURSE_ID}/oauth_callback",
})
