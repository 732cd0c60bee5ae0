"""A term of the course on a real JupyterHub (deploy/), on loopback, and the hub's settings.

The end-to-end test is one test on one hub: the instructor releases lab 00 through the formgrader
service, a student fetches it through their own server's Assignment List handlers, fills in the
reference solution through the contents API and submits; the instructor collects through the
formgrader, grades with ``python -m autograder autograde`` (the trusted engine) and makes and
releases feedback; the student fetches it and reads the engine's verdicts and no hidden test.
"""

import html
import importlib.util
import json
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
from traitlets.config import Config

from autograder import notebook
from autograder.course import Course
from autograder.submissions import reference_solutions
import e2e_times
from progress_lines import Lines

ROOT = Path(__file__).resolve().parent.parent
LAB = "00_measure"
COURSE_ID = "fastdl-lab"
STUDENT = "student1"
INSTRUCTOR = "instructor"
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", re.S)


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up by name while the module runs.
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


trial = load_module("fastdl_trial", ROOT / "deploy" / "trial.py")


class Hub:
    """One running hub: REST calls as a named user, with a token got by logging in; ``say`` puts
    a line on the terminal for each step of the term."""

    def __init__(self, setup, password: str, process: subprocess.Popen, log: Path, say: Lines):
        self.setup, self.password, self.process, self.log, self.say = setup, password, process, log, say
        self.tokens: dict[str, str] = {}

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def token(self, user: str) -> str:
        if user not in self.tokens:
            r = requests.post(f"{self.setup.url}/hub/api/users/{user}/tokens", timeout=30,
                              json={"auth": {"username": user, "password": self.password}, "expires_in": 3600})
            assert r.status_code == 201, r.text
            self.tokens[user] = r.json()["token"]
        return self.tokens[user]

    def call(self, method: str, user: str, path: str, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {self.token(user)}"}
        return requests.request(method, f"{self.setup.url}{path}", headers=headers, timeout=120, **kwargs)

    def ok(self, method: str, user: str, path: str, **kwargs):
        r = self.call(method, user, path, **kwargs)
        assert r.status_code < 300, f"{method} {path} as {user}: {r.status_code} {r.text[:500]}"
        return r.json() if r.content else None

    def start_server(self, user: str, timeout: float = 180) -> None:
        self.call("POST", user, f"/hub/api/users/{user}/server")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ok("GET", user, f"/hub/api/users/{user}")["servers"].get("", {}).get("ready"):
                return
            assert self.process.poll() is None, f"the hub died:\n{self.log_tail()}"
            time.sleep(0.5)
        raise AssertionError(f"{user}'s server did not start in {timeout} s:\n{self.log_tail()}")


def wait_until_up(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the hub exited:\n{log.read_text(errors='replace')[-3000:]}"
        try:
            # The formgrader is the last thing the hub starts before it answers.
            if requests.get(f"{url}/hub/api", timeout=5).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the hub did not answer in {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def stop(process: subprocess.Popen) -> list[str]:
    """Stop the hub as Ctrl-C would and return what it left running (then killed here): the
    proxy, servers, the formgrader service or their kernels."""
    mine = psutil.Process(process.pid).children(recursive=True)
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    _, alive = psutil.wait_procs(mine, timeout=10)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline()[:3])}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=10)
    return left


@pytest.fixture(scope="module")
def hub(tmp_path_factory, request):
    missing = trial.missing_prerequisites()
    if missing:
        pytest.skip("no JupyterHub here: " + "; ".join(missing))
    say = Lines(request.config, "term on the hub", e2e_times.HUB_TERM)
    port, api_port, proxy_api_port, formgrader_port = trial.free_ports(4)
    setup = trial.Trial(tmp_path_factory.mktemp("hub"), port=port, api_port=api_port, proxy_api_port=proxy_api_port,
                        formgrader_port=formgrader_port, instructors=(INSTRUCTOR,), students=(STUDENT, "student2"))
    say(f"building {LAB}'s course")
    trial.prepare(setup, [LAB])
    password = secrets.token_urlsafe(9)
    log = setup.state / "hub.log"
    with log.open("w") as out:
        process = subprocess.Popen(trial.command(), env=trial.environment(setup, password), cwd=setup.state,
                                   stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        say("starting JupyterHub, its proxy and the formgrader service")
        wait_until_up(setup.url, process, log)
        yield Hub(setup, password, process, log, say)
    finally:
        left = stop(process)
        assert not left, f"still running after the hub stopped (killed now): {left}"


def grader(setup, *args: str) -> subprocess.CompletedProcess:
    """The instructor's command line, in a terminal beside the hub."""
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run([sys.executable, "-m", "autograder", "--course", str(setup.course), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"autograder {args}: {done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.mark.slow
@pytest.mark.e2e
def test_a_term_on_the_hub(hub):
    setup, started = hub.setup, time.monotonic()
    formgrader = f"/services/{COURSE_ID}/formgrader/api"
    course = {"course_id": COURSE_ID, "assignment_id": LAB}
    student = f"/user/{STUDENT}"

    # Only instructors reach the formgrader; it lists the lab that `autograder build` made.
    assert hub.call("GET", STUDENT, f"{formgrader}/assignments").status_code == 403
    assert LAB in [a["name"] for a in hub.ok("GET", INSTRUCTOR, f"{formgrader}/assignments")]
    released = hub.ok("POST", INSTRUCTOR, f"{formgrader}/assignment/{LAB}/release")
    assert released["success"], released
    # nbgrader's exchange: everyone may write, no one may remove another's folder; the inbound
    # folder takes submissions but does not list them.
    assert setup.exchange.stat().st_mode & 0o7777 == 0o1777
    assert (setup.exchange / COURSE_ID / "inbound").stat().st_mode & 0o777 == 0o733

    hub.say(f"released {LAB}; starting {STUDENT}'s server")
    hub.start_server(STUDENT)
    listed = hub.ok("GET", STUDENT, f"{student}/assignments", params={"course_id": COURSE_ID})["value"]
    assert [(a["assignment_id"], a["status"]) for a in listed] == [(LAB, "released")]
    fetched = hub.ok("POST", STUDENT, f"{student}/assignments/fetch", data=course)
    assert fetched["success"], fetched
    contents = f"{student}/api/contents/{LAB}/{LAB}.ipynb"
    nb = hub.ok("GET", STUDENT, contents)["content"]
    assert "BEGIN SOLUTION" not in json.dumps(nb) and "HIDDEN TESTS" not in json.dumps(nb)
    solutions = reference_solutions(Course(setup.course), LAB)
    for cell in nb["cells"]:
        grade_id = cell["metadata"].get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell["source"] = solutions[grade_id]
    hub.ok("PUT", STUDENT, contents, json={"type": "notebook", "format": "json", "content": nb})
    submitted = hub.ok("POST", STUDENT, f"{student}/assignments/submit", data=course)
    assert submitted["success"], submitted

    hub.say(f"{STUDENT} fetched and submitted {LAB}; collecting it")
    collected = hub.ok("POST", INSTRUCTOR, f"{formgrader}/assignment/{LAB}/collect")
    assert collected["success"], collected
    # One account runs every server of the trial: no owner warning for an honest submission.
    assert "cheating attempt" not in collected["log"], collected["log"]
    assert (setup.course / "submitted" / STUDENT / LAB / f"{LAB}.ipynb").is_file()
    graded_at = time.monotonic()
    hub.say(f"grading {LAB} with `autograder autograde --engine-only`")
    # The engine alone: nbgrader's run of the notebook (for formgrader's view of the outputs) is
    # tested in test_grading_pipeline.py and would double this test's time.
    grader(setup, "autograde", LAB, "--engine-only")
    hub.say(f"autograde took {time.monotonic() - graded_at:.0f} s")
    record = json.loads((setup.course / "records" / LAB / f"{STUDENT}.json").read_text())
    verdicts = {item["item"]: item for item in record["items"]}
    assert {name: v["status"] for name, v in verdicts.items()} == {"roofline": "passed", "timing": "passed"}, verdicts
    # The formgrader shows the engine's total.
    scores = {s["student"]: s["score"] for s in hub.ok("GET", INSTRUCTOR, f"{formgrader}/submissions/{LAB}")}
    assert scores[STUDENT] == sum(v["score"] for v in verdicts.values()) == 7

    feedback_at = time.monotonic()
    grader(setup, "feedback", LAB)
    hub.say(f"feedback took {time.monotonic() - feedback_at:.0f} s; releasing it to {STUDENT}")
    released = hub.ok("POST", INSTRUCTOR, f"{formgrader}/assignment/{LAB}/release_feedback")
    assert released["success"], released
    listed = hub.ok("POST", STUDENT, f"{student}/assignments/fetch_feedback", data=course)["value"]
    feedback_dirs = [s.get("local_feedback_path") for a in listed if a["status"] == "submitted" for s in a["submissions"]]
    assert len(feedback_dirs) == 1 and feedback_dirs[0], listed
    feedback_dir = feedback_dirs[0]
    page = hub.call("GET", STUDENT, f"{student}/files/{feedback_dir}/{LAB}.html")
    assert page.status_code == 200, page.text[:300]
    text = html.unescape(page.text)
    for name, v in verdicts.items():
        assert f"Autograder verdict for '{name}': {v['score']:g} / {v['max_score']:g} points [passed]" in text
    source = (ROOT / "labs" / f"{LAB}.py").read_text()
    hidden = [ln.strip() for block in HIDDEN.findall(source) for ln in block.splitlines() if len(ln.strip()) > 20]
    assert hidden, "lab 00 has hidden tests to look for"
    assert [ln for ln in hidden if ln in text] == []
    hub.say(f"done: {time.monotonic() - started:.0f} s after the hub was up")


def load_config(monkeypatch, **env) -> tuple[Config, dict]:
    for name in list(os.environ):
        if name.startswith("FASTDL_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = Config()
    namespace = {"get_config": lambda: config, "__file__": str(ROOT / "deploy" / "jupyterhub_config.py")}
    exec(compile((ROOT / "deploy" / "jupyterhub_config.py").read_text(), "jupyterhub_config.py", "exec"), namespace)
    return config, namespace


def test_course_mode_uses_accounts_and_keeps_roles_apart(monkeypatch):
    config, ns = load_config(monkeypatch, FASTDL_INSTRUCTORS="ada", FASTDL_STUDENTS="bob,cy")
    # Unix accounts (JupyterHub's PAM login and local process spawner): nothing set means the defaults.
    assert "authenticator_class" not in config.JupyterHub and "spawner_class" not in config.JupyterHub
    assert config.Authenticator.allowed_users == {"ada", "bob", "cy"}
    assert config.JupyterHub.load_groups == {"formgrade-fastdl-lab": {"users": ["ada"]},
                                             "nbgrader-fastdl-lab": {"users": ["bob", "cy"]}}
    (service,) = config.JupyterHub.services
    assert service["name"] == COURSE_ID and service["user"] == "grader-fastdl-lab"
    assert service["environment"]["PYTHONPATH"] == "/opt/fastdl/instructor"
    student, instructor = ns["role_environment"]("student"), ns["role_environment"]("instructor")
    assert student["PYTHONPATH"] == "/opt/fastdl/student" and "FASTDL_COURSE_DIR" not in student
    assert instructor["PYTHONPATH"] == "/opt/fastdl/instructor"
    assert student["JUPYTER_CONFIG_PATH"].split(os.pathsep)[0].endswith("deploy/jupyter/student")
    assert ns["role_of"]({"nbgrader-fastdl-lab"}) == "student"
    assert ns["role_of"]({"nbgrader-fastdl-lab", "formgrade-fastdl-lab"}) == "instructor"
    with pytest.raises(PermissionError, match="not on the fastdl-lab roster"):
        ns["role_of"]({"another-course"})


def test_only_the_one_account_trial_turns_nbgraders_owner_check_off(monkeypatch, tmp_path):
    from traitlets.config.loader import PyFileConfigLoader

    _, course_ns = load_config(monkeypatch, FASTDL_INSTRUCTORS="ada", FASTDL_STUDENTS="bob")
    assert "FASTDL_ONE_ACCOUNT" not in course_ns["role_environment"]("grader")
    env = {k: v for k, v in trial.environment(trial.Trial(tmp_path), "pw").items() if k.startswith("FASTDL_")}
    _, trial_ns = load_config(monkeypatch, **env)
    # The formgrader service and an instructor's terminal both collect.
    for role in ("grader", "instructor"):
        monkeypatch.setattr(os, "environ", {**os.environ, **trial_ns["role_environment"](role)})
        config = PyFileConfigLoader("nbgrader_config.py", str(ROOT / "deploy" / "jupyter" / "course")).load_config()
        assert config.ExchangeCollect.check_owner is False
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "FASTDL_ONE_ACCOUNT"})
    config = PyFileConfigLoader("nbgrader_config.py", str(ROOT / "deploy" / "jupyter" / "course")).load_config()
    assert "check_owner" not in config.ExchangeCollect


def test_config_refuses_a_bad_mode_and_a_name_on_both_rosters(monkeypatch):
    with pytest.raises(ValueError, match="FASTDL_HUB_MODE must be"):
        load_config(monkeypatch, FASTDL_HUB_MODE="open")
    with pytest.raises(ValueError, match=r"on both rosters .*\['ada'\]"):
        load_config(monkeypatch, FASTDL_INSTRUCTORS="ada", FASTDL_STUDENTS="ada,bob")


def test_trial_mode_is_loopback_with_a_password(monkeypatch, tmp_path):
    setup = trial.Trial(tmp_path, port=18123)
    env = {k: v for k, v in trial.environment(setup, "pw").items() if k.startswith("FASTDL_")}
    config, _ = load_config(monkeypatch, **env)
    assert config.JupyterHub.bind_url == "http://127.0.0.1:18123/"
    assert config.JupyterHub.authenticator_class == "dummy" and config.DummyAuthenticator.password == "pw"
    assert config.SimpleLocalProcessSpawner.home_dir_template == f"{tmp_path}/home/{{username}}"
    (service,) = config.JupyterHub.services
    assert "user" not in service and service["environment"]["FASTDL_COURSE_DIR"] == str(setup.course)


@pytest.mark.parametrize("role, formgrader, assignment_list", [
    ("student", False, True), ("instructor", False, True), ("grader", True, False),
    ("selfstudy", False, False)])
def test_each_role_sees_its_own_nbgrader_tools(role, formgrader, assignment_list):
    settings = json.loads((ROOT / "deploy" / "jupyter" / role / "jupyter_server_config.json").read_text())
    enabled = settings["ServerApp"]["jpserver_extensions"]
    assert enabled["nbgrader.server_extensions.formgrader"] is formgrader
    assert enabled["nbgrader.server_extensions.assignment_list"] is assignment_list
    disabled = json.loads((ROOT / "deploy" / "jupyter" / role / "labconfig" / "page_config.json").read_text())
    assert disabled["disabledExtensions"].get("@jupyter/nbgrader:formgrader", False) is not formgrader


def _lab_settings(role: str) -> tuple[dict, dict, dict]:
    folder = ROOT / "deploy" / "jupyter" / role
    server = json.loads((folder / "jupyter_server_config.json").read_text())
    disabled = json.loads((folder / "labconfig" / "page_config.json").read_text())["disabledExtensions"]
    overrides_file = folder / "labconfig" / "default_setting_overrides.json"
    overrides = json.loads(overrides_file.read_text()) if overrides_file.exists() else {}
    return server, disabled, overrides


@pytest.mark.parametrize("role", ["student", "selfstudy"])
def test_a_students_jupyterlab_asks_nothing_and_goes_nowhere(role):
    """No news pop-up (nor the server's fetch behind it, nor its update check) and a notebook's
    kernel started without a "Select Kernel" dialog; the browser test sees it in self-study."""
    server, disabled, overrides = _lab_settings(role)
    assert disabled.get("@jupyterlab/apputils-extension:announcements") is True
    assert server["LabApp"]["news_url"] is None
    assert server["LabApp"]["check_for_updates_class"].endswith(".NeverCheckForUpdate")
    assert overrides["@jupyterlab/notebook-extension:tracker"]["autoStartDefaultKernel"] is True


def test_the_nbgrader_menu_is_there_only_where_it_holds_something():
    """Self-study has no nbgrader list to open, so no menu; the other roles keep theirs."""
    assert _lab_settings("selfstudy")[1].get("@jupyter/nbgrader:menu") is True
    assert _lab_settings("selfstudy")[0]["MultiKernelManager"]["default_kernel_name"] == "fastdl-student"
    for role in ("student", "instructor", "grader"):
        assert not _lab_settings(role)[1].get("@jupyter/nbgrader:menu"), role


def test_exchange_notes_are_read_like_submissions(tmp_path):
    """timestamp.txt and submission_secret.txt sit in the student's folder: no links, no FIFOs,
    nothing long, and the time must be one."""
    (tmp_path / "timestamp.txt").write_text("2026-11-23 16:46:05.289252 UTC\n")
    assert notebook.read_exchange_note(tmp_path, "timestamp.txt") == "2026-11-23 16:46:05.289252 UTC"
    assert notebook.read_exchange_note(tmp_path, "submission_secret.txt") is None
    (tmp_path / "submission_secret.txt").write_text("x" * 300)
    with pytest.raises(notebook.NotebookError, match="longer than 256"):
        notebook.read_exchange_note(tmp_path, "submission_secret.txt")
    (tmp_path / "timestamp.txt").write_text("yesterday")
    with pytest.raises(notebook.NotebookError, match="does not hold a time"):
        notebook.read_exchange_note(tmp_path, "timestamp.txt")
    (tmp_path / "timestamp.txt").unlink()
    (tmp_path / "timestamp.txt").symlink_to("/etc/passwd")
    with pytest.raises(notebook.NotebookError, match="refused"):
        notebook.read_exchange_note(tmp_path, "timestamp.txt")
    (tmp_path / "submission_secret.txt").unlink()
    os.mkfifo(tmp_path / "submission_secret.txt")
    with pytest.raises(notebook.NotebookError, match="refused"):
        notebook.read_exchange_note(tmp_path, "submission_secret.txt")


def test_image_environment_holds_no_copy_of_the_package():
    """Whatever environment.yml installs, every student can read: the package (solutions included)
    must come from the image's per-role folders instead, and the pins must be pyproject's."""
    import tomllib

    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert [p for p in pip if p.startswith(("-e", ".", "/", "file:")) or "fastdl" in p] == []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["hub"])
    assert wanted - set(pip) == set()
