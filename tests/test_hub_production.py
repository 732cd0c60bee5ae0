"""The production hub (deploy/production/): its configuration loaded as JupyterHub loads it, with
each spawner; the Helm values against the same numbers; the images where a Docker engine answers;
and nbgrader's owner check on collect, with the uids the roster gives."""

import datetime
import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from autograder import roster

ROOT = Path(__file__).resolve().parent.parent
PRODUCTION = ROOT / "deploy" / "production"
CONFIG = PRODUCTION / "jupyterhub_config.py"
sys.path.insert(0, str(PRODUCTION))
import limits  # noqa: E402

USERS = {"instructors": ["prof"], "students": ["ada", "bob"], "uids": {"ada": 20000, "bob": 20001, "prof": 20002},
         "gid": 100}
OAUTH = {"FASTDL_OAUTH_CLIENT_ID": "hub", "FASTDL_OAUTH_CLIENT_SECRET": "s3cret",
         "FASTDL_OAUTH_AUTHORIZE_URL": "https://sso.example.org/auth", "FASTDL_OAUTH_TOKEN_URL": "https://sso.example.org/token",
         "FASTDL_OAUTH_USERDATA_URL": "https://sso.example.org/userinfo"}
LTI = {"FASTDL_AUTH": "lti13", "FASTDL_LTI_ISSUER": "https://canvas.example.org",
       "FASTDL_LTI_AUTHORIZE_URL": "https://canvas.example.org/api/lti/authorize_redirect",
       "FASTDL_LTI_JWKS_URL": "https://canvas.example.org/api/lti/security/jwks", "FASTDL_LTI_CLIENT_ID": "10000000042"}


def load(monkeypatch, tmp_path, spawner: str, **env):
    """The production configuration as `jupyterhub -f` reads it (traitlets' loader, through the
    JupyterHub application), with a roster of two students and an instructor."""
    from jupyterhub.app import JupyterHub

    for name in list(os.environ):
        if name.startswith("FASTDL_"):
            monkeypatch.delenv(name)
    (tmp_path / "roster.json").write_text(json.dumps(USERS))
    settings = {"FASTDL_SPAWNER": spawner, "FASTDL_ROSTER": str(tmp_path / "roster.json"),
                "FASTDL_PUBLIC_URL": "https://hub.example.org/", "FASTDL_FORMGRADER_TOKEN": "t0ken",
                "FASTDL_HUB_STATE": str(tmp_path), "FASTDL_SSL_CERT": "/tls/cert.pem", "FASTDL_SSL_KEY": "/tls/key.pem",
                **OAUTH, **env}
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    app = JupyterHub()
    app.load_config_file(str(CONFIG))
    return app.config


def unknown_settings(config, section: str, cls) -> set[str]:
    """Names set in ``config[section]`` that ``cls`` has no configurable trait for (a typo would
    otherwise be ignored with a warning in the hub's log)."""
    return set(config[section]) - set(cls.class_traits(config=True))


def fake_spawner(name: str, groups=()):
    return SimpleNamespace(user=SimpleNamespace(name=name, groups=[SimpleNamespace(name=g) for g in groups]),
                           environment={})


def test_docker_spawner_limits_volumes_gpu_and_uid(monkeypatch, tmp_path):
    pytest.importorskip("dockerspawner", reason="dockerspawner is not installed (pip install -e '.[test]')")
    from dockerspawner import DockerSpawner

    config = load(monkeypatch, tmp_path, "docker", FASTDL_GPU_DEVICES="1,2,3")
    assert config.JupyterHub.spawner_class == "docker"
    assert unknown_settings(config, "DockerSpawner", DockerSpawner) == set()
    assert config.Spawner.mem_limit == limits.MEM_LIMIT == 6 * 1024**3 and config.Spawner.cpu_limit == limits.CPU_LIMIT
    assert config.DockerSpawner.volumes == {"fastdl-home-{username}": "/home/student",
                                            "fastdl-exchange": "/srv/nbgrader/exchange"}
    assert config.DockerSpawner.network_name == "fastdl-hub" and config.DockerSpawner.remove is True

    spawner = fake_spawner("ada")
    config.DockerSpawner.pre_spawn_hook(spawner)
    # The roster's uid, so the exchange's files say who wrote them; a GPU of the students' list.
    assert spawner.extra_create_kwargs == {"user": "20000:100"}
    (request,) = spawner.extra_host_config["device_requests"]
    assert request["DeviceIDs"] == [["1", "2", "3"][20000 % 3]] and request["Capabilities"] == [["gpu"]]
    assert spawner.environment["PYTHONPATH"] == "/opt/fastdl/student" and spawner.environment["USER"] == "ada"
    assert spawner.environment["JUPYTER_CONFIG_PATH"].startswith("/opt/fastdl/jupyter/student")
    instructor = fake_spawner("prof", ["formgrade-fastdl-lab"])
    config.DockerSpawner.pre_spawn_hook(instructor)
    # An instructor's own server has the instructor's tools, never the solutions.
    assert instructor.environment["JUPYTER_CONFIG_PATH"].startswith("/opt/fastdl/jupyter/instructor")
    assert instructor.environment["PYTHONPATH"] == "/opt/fastdl/student"

    # TLS on the hub's own port, the culler as a service with the rights it needs and no more.
    assert config.JupyterHub.bind_url == "https://0.0.0.0:443/"
    assert (config.JupyterHub.ssl_cert, config.JupyterHub.ssl_key) == ("/tls/cert.pem", "/tls/key.pem")
    services = {s["name"]: s for s in config.JupyterHub.services}
    assert services["idle-culler"]["command"][1:] == ["-m", "jupyterhub_idle_culler", "--timeout=3600",
                                                      "--cull-every=600"]
    roles = {r["name"]: r for r in config.JupyterHub.load_roles}
    assert set(roles["idle-culler"]["scopes"]) == {"list:users", "read:users:activity", "read:servers", "delete:servers"}
    assert roles["course-instructor"]["groups"] == ["formgrade-fastdl-lab"]
    assert services["fastdl-lab"]["url"] == "http://formgrader:9999" and "command" not in services["fastdl-lab"]


def test_docker_spawner_without_gpus_requests_none(monkeypatch, tmp_path):
    pytest.importorskip("dockerspawner", reason="dockerspawner is not installed (pip install -e '.[test]')")
    config = load(monkeypatch, tmp_path, "docker")
    spawner = fake_spawner("bob")
    config.DockerSpawner.pre_spawn_hook(spawner)
    assert spawner.extra_create_kwargs == {"user": "20001:100"} and not hasattr(spawner, "extra_host_config")


def test_kube_spawner_limits_homes_gpu_profile_and_uid(monkeypatch, tmp_path):
    pytest.importorskip("kubespawner", reason="jupyterhub-kubespawner is not installed (pip install -e '.[test]')")
    from kubespawner import KubeSpawner

    config = load(monkeypatch, tmp_path, "kubernetes")
    assert config.JupyterHub.spawner_class == "kubespawner.KubeSpawner"
    assert unknown_settings(config, "KubeSpawner", KubeSpawner) == set()
    assert (config.Spawner.mem_guarantee, config.Spawner.cpu_guarantee) == (limits.MEM_GUARANTEE, limits.CPU_GUARANTEE)
    assert config.KubeSpawner.uid(fake_spawner("bob")) == 20001 and config.KubeSpawner.fs_gid == 100
    assert config.KubeSpawner.storage_capacity == "10Gi" and config.KubeSpawner.storage_pvc_ensure is True
    mounts = {m["name"]: m["mountPath"] for m in config.KubeSpawner.volume_mounts}
    assert mounts == {"home": "/home/student", "exchange": "/srv/nbgrader/exchange"}
    cpu, gpu = config.KubeSpawner.profile_list
    assert cpu["default"] and "kubespawner_override" not in cpu
    assert gpu["kubespawner_override"] == {"extra_resource_limits": {"nvidia.com/gpu": "1"}}
    # The profile's overrides are KubeSpawner's own settings.
    assert set(gpu["kubespawner_override"]) <= set(KubeSpawner.class_traits(config=True))
    # The chart runs the culler and owns TLS and the hub's network: this file adds neither.
    assert [s["name"] for s in config.JupyterHub.services] == ["fastdl-lab"]
    assert "ssl_cert" not in config.JupyterHub and "bind_url" not in config.JupyterHub


def mock_user(name: str, groups=()):
    from unittest.mock import Mock

    user = Mock()
    user.name, user.escaped_name, user.url, user.id = name, name, f"/user/{name}/", 1
    user.groups = [SimpleNamespace(name=g) for g in groups]
    return user


def test_a_docker_spawner_made_from_the_configuration_binds_the_users_volumes(monkeypatch, tmp_path):
    pytest.importorskip("dockerspawner", reason="dockerspawner is not installed (pip install -e '.[test]')")
    from dockerspawner import DockerSpawner

    config = load(monkeypatch, tmp_path, "docker")
    spawner = DockerSpawner(config=config, _deprecated_db_session=None, user=mock_user("ada"))
    assert (spawner.mem_limit, spawner.cpu_limit) == (limits.MEM_LIMIT, limits.CPU_LIMIT)
    assert spawner.volume_binds == {"fastdl-home-ada": {"bind": "/home/student", "mode": "rw"},
                                    "fastdl-exchange": {"bind": "/srv/nbgrader/exchange", "mode": "rw"}}


def test_the_pods_kubespawner_would_ask_for(monkeypatch, tmp_path, request):
    """KubeSpawner's own pod manifest for a student, with the CPU profile and with the GPU one: made
    offline (a kube config that points nowhere; nothing is sent to a cluster)."""
    import asyncio

    pytest.importorskip("kubespawner", reason="jupyterhub-kubespawner is not installed (pip install -e '.[test]')")
    from kubespawner import KubeSpawner

    kube = tmp_path / "kubeconfig"
    kube.write_text("apiVersion: v1\nkind: Config\ncurrent-context: offline\n"
                    "clusters: [{name: offline, cluster: {server: 'https://127.0.0.1:9'}}]\n"
                    "contexts: [{name: offline, context: {cluster: offline, user: offline, namespace: fastdl}}]\n"
                    "users: [{name: offline, user: {token: offline}}]\n")
    # The client library reads KUBECONFIG when it is imported, and KubeSpawner loads it once per process.
    import kubernetes_asyncio.config.kube_config as kube_config
    from kubespawner import clients

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kube))
    clients.load_config.cache_clear()
    request.addfinalizer(clients.load_config.cache_clear)
    config = load(monkeypatch, tmp_path, "kubernetes")

    async def pod(profile: str):
        spawner = KubeSpawner(config=config, _mock=True, user=mock_user("bob", ["nbgrader-fastdl-lab"]))
        spawner.user_options = {"profile": profile}
        await spawner.load_user_options()
        config.KubeSpawner.pre_spawn_hook(spawner)
        return await spawner.get_pod_manifest()

    cpu, gpu = asyncio.run(pod("cpu")), asyncio.run(pod("gpu"))
    container = cpu.spec.containers[0]
    assert container.resources.limits == {"cpu": limits.CPU_LIMIT, "memory": limits.MEM_LIMIT}
    assert container.resources.requests == {"cpu": limits.CPU_GUARANTEE, "memory": limits.MEM_GUARANTEE}
    assert gpu.spec.containers[0].resources.limits["nvidia.com/gpu"] == str(limits.GPU_COUNT)
    assert container.security_context["runAsUser"] == 20001 and cpu.spec.security_context["fsGroup"] == 100
    claims = {v.name: v.persistent_volume_claim["claimName"] for v in cpu.spec.volumes if v.persistent_volume_claim}
    assert claims == {"home": "fastdl-home-bob", "exchange": "fastdl-exchange"}
    env = {e.name: e.value for e in container.env}
    assert env["PYTHONPATH"] == "/opt/fastdl/student" and env["USER"] == "bob"


@pytest.mark.parametrize("auth, cls_path", [("oauth", "oauthenticator.generic.GenericOAuthenticator"),
                                            ("lti13", "ltiauthenticator.lti13.auth.LTI13Authenticator")])
def test_each_authenticator_loads_with_known_settings(monkeypatch, tmp_path, auth, cls_path):
    module, _, name = cls_path.rpartition(".")
    cls = getattr(pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[test]')"), name)
    config = load(monkeypatch, tmp_path, "docker", **(LTI if auth == "lti13" else {}))
    section = name
    assert unknown_settings(config, section, cls) == set()
    assert config.Authenticator.allowed_users == {"ada", "bob", "prof"}
    if auth == "oauth":
        assert config.GenericOAuthenticator.oauth_callback_url == "https://hub.example.org/hub/oauth_callback"
        assert config.JupyterHub.authenticator_class == "generic-oauth"
    else:
        assert config.LTI13Authenticator.client_id == ["10000000042"]


def test_the_production_hub_refuses_to_run_without_tls_or_a_roster(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="no TLS"):
        load(monkeypatch, tmp_path, "docker", FASTDL_SSL_CERT="", FASTDL_SSL_KEY="")
    config = load(monkeypatch, tmp_path, "docker", FASTDL_SSL_CERT="", FASTDL_TLS_UPSTREAM="1")
    assert config.JupyterHub.bind_url == "http://0.0.0.0:8000/"
    with pytest.raises(FileNotFoundError, match="roster import roster.csv --hub"):
        load(monkeypatch, tmp_path, "docker", FASTDL_ROSTER=str(tmp_path / "none.json"))
    with pytest.raises(ValueError, match="FASTDL_SPAWNER must be one of docker, kubernetes"):
        load(monkeypatch, tmp_path, "slurm")


def test_helm_values_agree_with_the_python_configuration():
    import yaml
    from jupyterhub.traitlets import ByteSpecification

    values = yaml.safe_load((PRODUCTION / "z2jh-values.yaml").read_text())
    single = values["singleuser"]
    # The chart hands these strings to KubeSpawner, which reads them as JupyterHub does (G = 1024**3).
    def as_bytes(text):
        return ByteSpecification().validate(None, text)

    assert as_bytes(single["memory"]["limit"]) == limits.MEM_LIMIT
    assert as_bytes(single["memory"]["guarantee"]) == limits.MEM_GUARANTEE
    assert (single["cpu"]["limit"], single["cpu"]["guarantee"]) == (limits.CPU_LIMIT, limits.CPU_GUARANTEE)
    assert single["storage"]["capacity"] == limits.HOME_CAPACITY and single["storage"]["type"] == "dynamic"
    assert single["storage"]["homeMountPath"] == "/home/student"
    assert single["storage"]["dynamic"]["pvcNameTemplate"] == "fastdl-home-{username}"
    assert single["storage"]["extraVolumeMounts"] == [{"name": "exchange", "mountPath": "/srv/nbgrader/exchange"}]
    assert single["fsGid"] == roster.COURSE_GID
    assert single["networkPolicy"]["egressAllowRules"]["privateIPs"] is False
    cull = values["cull"]
    assert cull["enabled"] and (cull["timeout"], cull["every"]) == (limits.CULL_TIMEOUT_S, limits.CULL_EVERY_S)
    assert values["proxy"]["https"]["enabled"] is True
    assert values["hub"]["extraEnv"]["FASTDL_SPAWNER"] == "kubernetes"


def test_the_hub_images_packages_are_the_ones_tested():
    """requirements-hub.txt pins what the hub image installs; the test extra installs the same
    packages, so that this file loads the configuration with them."""
    import tomllib

    from packaging.requirements import Requirement

    pinned = {Requirement(line).name for line in (PRODUCTION / "requirements-hub.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    extra = {Requirement(r).name for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
             ["optional-dependencies"]["test"]}
    assert pinned - extra == set()


def test_compose_keeps_grading_off_the_students_network(monkeypatch, tmp_path):
    """The names the hub's configuration uses are the compose file's, and nothing that runs
    submitted code or takes Dask tasks shares a network with students' servers."""
    import yaml

    compose = yaml.safe_load((PRODUCTION / "docker-compose.yml").read_text())
    config = load(monkeypatch, tmp_path, "docker")
    networks = {key: net["name"] for key, net in compose["networks"].items()}
    students_net = config.DockerSpawner.network_name
    assert students_net in networks.values() and compose["networks"]["grading"]["internal"] is True
    on_students_net = {name for name, svc in compose["services"].items()
                       if any(networks[n] == students_net for n in svc["networks"])}
    assert on_students_net == {"hub", "formgrader"}
    volumes = {vol.get("name") for vol in compose["volumes"].values() if vol}
    assert set(config.DockerSpawner.volumes) - {"fastdl-home-{username}"} <= volumes
    assert compose["services"]["hub"]["image"] == "fastdl-lab-hub-production"


def test_the_images_copy_only_what_exists_and_the_grader_script_parses():
    for dockerfile in ("Dockerfile.hub", "Dockerfile.student"):
        for line in (PRODUCTION / dockerfile).read_text().splitlines():
            if line.startswith("COPY") and "--from" not in line:
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile}: {source}"
    assert subprocess.run(["bash", "-n", str(PRODUCTION / "start-grader.sh")]).returncode == 0


def docker_engine() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("dockerfile", ["deploy/production/Dockerfile.hub", "deploy/production/Dockerfile.student",
                                        "deploy/Dockerfile"])
def test_the_images_build(dockerfile):
    if not docker_engine():
        pytest.skip("no Docker engine on this machine")
    done = subprocess.run(["docker", "build", "-f", dockerfile, "-t", f"fastdl-test-{Path(dockerfile).name.lower()}",
                           "."], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    if dockerfile.endswith("student"):
        # The student image holds no solution: the first stage's layers are not in it.
        listed = subprocess.run(["docker", "run", "--rm", "fastdl-test-dockerfile.student", "grep", "-rl",
                                 "BEGIN SOLUTION", "/opt/fastdl"], capture_output=True, text=True, timeout=300)
        assert listed.stdout == ""


# --- nbgrader's owner check on collect ------------------------------------------------------------

def submit(exchange: Path, student: str, lab: str = "00_measure") -> Path:
    """A submission in the exchange as nbgrader's submit files it (owned by this process's user)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f %Z")
    folder = exchange / "fastdl-lab" / "inbound" / f"{student}+{lab}+{stamp}+abc"
    folder.mkdir(parents=True)
    (folder / f"{lab}.ipynb").write_text("{}")
    (folder / "timestamp.txt").write_text(stamp)
    return folder


def collect(tmp_path: Path, exchange: Path, caplog, passwd: list[str] | None) -> str:
    """nbgrader's own collect of lab 00; with ``passwd``, user names are looked up in those lines,
    as they are in a grading container whose /etc/passwd has them (start-grader.sh)."""
    from nbgrader.coursedir import CourseDirectory
    from nbgrader.exchange.default import collect as collect_module

    if passwd is not None:
        entries = {int(line.split(":")[2]): line.split(":")[0] for line in passwd}
        lookup = SimpleNamespace(getpwuid=lambda uid: SimpleNamespace(pw_name=entries[uid]))
    else:
        lookup = pwd
    coursedir = CourseDirectory(root=str(tmp_path / "course"), course_id="fastdl-lab", assignment_id="00_measure")
    (tmp_path / "course").mkdir(exist_ok=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        app = collect_module.ExchangeCollect(coursedir=coursedir, root=str(exchange), update=True,
                                             log=logging.getLogger("collect"))
        original = collect_module.pwd
        collect_module.pwd = lookup
        try:
            app.start()
        finally:
            collect_module.pwd = original
    return caplog.text


def test_collect_trusts_an_honest_submission_and_flags_an_impersonation(tmp_path, caplog):
    exchange = tmp_path / "exchange"
    submit(exchange, "ada")
    # The grading container knows the students' uids by name: the roster gave ada this process's uid.
    lines = roster.passwd_lines({"uids": {"ada": os.getuid(), "bob": os.getuid() + 1}, "gid": 100})
    assert "cheating attempt" not in collect(tmp_path, exchange, caplog, lines)
    assert (tmp_path / "course" / "submitted" / "ada" / "00_measure" / "00_measure.ipynb").is_file()
    # A folder filed under bob's name by ada's uid is what the warning is for.
    submit(exchange, "bob")
    assert "claims to be submitted by bob but is owned by ada; cheating attempt?" in collect(tmp_path, exchange, caplog,
                                                                                             lines)
    # Without the roster's names (every server under one account, the trial hub), every honest
    # submission would be flagged: that is why the trial turns the check off.
    assert pwd.getpwuid(os.getuid()).pw_name != "ada"
    assert "claims to be submitted by ada" in collect(tmp_path, exchange, caplog, None)
