"""The course in a real browser: Debian's Chromium driven by Playwright (no browser download).

Two private JupyterLab servers (loopback, a token, their own JUPYTER_* folders). One is `make lab`
itself (`python -m autograder lab`, the self-study settings, the fastdl-student kernel) on a copy of
the demo course built for test_grading_pipeline.py: a learner opens lab 00 and meets no dialog, no
news and no empty menu, the kernel starts by itself, a cell runs and Validate reports. The other
serves the graded demo course to formgrader, where an instructor sees the engine's scores. A
feedback page renders from the file system with the network cut off: its equations are drawn and
no hidden test shows. Pages may reach the loopback servers and files only. Screenshots go to
build/screenshots/.
"""

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from autograder import pipeline, selfstudy
from autograder.course import COURSE_ID, copy_build
from autograder.engine.items import load_lab
from autograder.engine.sandbox import descendants
from fastdl_lab.distributed.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM = Path(os.environ.get("FASTDL_CHROMIUM", "/usr/bin/chromium"))
LAB = "00_measure"
FEEDBACK_STUDENT = "buggy-flops"
# Waits are generous: on a busy 2-core machine a kernel's first import of torch took over a minute,
# and Validate executes the whole notebook.
PAGE_TIMEOUT_MS = 90_000
KERNEL_TIMEOUT_MS = 240_000


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: run `make browser-tool` (apt-get install chromium) "
                    "or set FASTDL_CHROMIUM")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is missing: "
                                   "reinstall the test environment (pip install -e '.[test]')")
    with sync_api.sync_playwright() as playwright:
        # Chromium's own sandbox refuses to start as root, which is how CI runs.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=args)
        yield chromium
        chromium.close()


def private_jupyter(folder: Path) -> dict[str, str]:
    """This machine's environment with every Jupyter folder of its own under ``folder``: nothing of
    the user's settings, kernels or workspaces reaches the page, and the test writes none of theirs."""
    jupyter = folder / "jupyter"
    return {**os.environ,
            "JUPYTER_CONFIG_DIR": str(jupyter / "config"), "JUPYTER_DATA_DIR": str(jupyter / "data"),
            "JUPYTER_RUNTIME_DIR": str(jupyter / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(jupyter / "lab-settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(jupyter / "workspaces"), "IPYTHONDIR": str(folder / "ipython")}


class LabServer:
    """A JupyterLab server on loopback, a random port and token, started by ``argv`` (to which
    the address options are added) in ``cwd``; its log in ``folder``."""

    def __init__(self, folder: Path, argv: list[str], env: dict[str, str], cwd: Path):
        self.folder = folder
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = (folder / "server.log").open("w")
        self.proc = subprocess.Popen(
            [*argv, "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}"],
            cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @classmethod
    def make_lab(cls, folder: Path, course) -> "LabServer":
        """`make lab` itself: `python -m autograder lab` (the command the Makefile runs) on
        ``course``, working copies in ``folder``/work, the student kernel installed in the private
        data folder. One difference: quick experiments, so that Validate runs the lab in minutes."""
        env = {**private_jupyter(folder), selfstudy.WORK_VAR: str(folder / "work"), "FASTDL_QUICK": "1"}
        argv = [sys.executable, "-m", "autograder", "--course", str(course.root), "lab"]
        return cls(folder, argv, env, cwd=folder)

    @classmethod
    def formgrader(cls, folder: Path) -> "LabServer":
        """A plain server in ``folder``, whose nbgrader_config.py names the graded course."""
        argv = [sys.executable, "-m", "jupyter", "lab", "--allow-root", f"--ServerApp.root_dir={folder}"]
        return cls(folder, argv, private_jupyter(folder), cwd=folder)

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}"

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url("api/status"), timeout=5) as response:
                    json.load(response)
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer in {timeout_s} s: {self.tail()}")

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.folder / "server.log").read_text()[-3000:]

    def stop(self) -> list[int]:
        """Shut the server down with its kernels, end whatever it started that is left, and return
        the processes of the server's tree still running after that (none, unless unkillable)."""
        started = descendants(self.proc.pid)
        if self.proc.poll() is None:
            try:
                request = urllib.request.Request(self.url("api/shutdown"), method="POST")
                urllib.request.urlopen(request, timeout=10).close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # Kernels run in sessions of their own, out of reach of the server's process group.
        for pid in started:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()
        deadline = time.monotonic() + 10
        while [pid for pid in started if _running(pid)] and time.monotonic() < deadline:
            time.sleep(0.1)
        return [pid for pid in started if _running(pid)]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its parent is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The state follows the command name, which is in parentheses and may hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _graded_copy(graded, root: Path):
    """The demo course with its submissions, grades and records, where the browser may change it."""
    copy = copy_build(graded, root)
    for entry in graded.root.iterdir():
        if not (copy.root / entry.name).exists():
            shutil.copytree(entry, copy.root / entry.name, symlinks=True)
    return copy


@contextlib.contextmanager
def _serving(lab_server: LabServer):
    try:
        lab_server.wait_ready()
        yield lab_server
    finally:
        left = lab_server.stop()
    assert not left, f"processes of the JupyterLab server still running after its shutdown: {left}"


@pytest.fixture(scope="module")
def server(demo, tmp_path_factory):
    """The formgrader's server on the graded demo course, and that course."""
    folder = tmp_path_factory.mktemp("browser")
    course = _graded_copy(demo[LAB].course, folder / "course")
    # The feedback test's page: made here, in the copy, for a student who lost points.
    assert pipeline.feedback(course, load_lab(LAB), [FEEDBACK_STUDENT]) == []
    (folder / "exchange").mkdir()
    # Formgrader reads the course from an nbgrader_config.py in the server's working folder, and the
    # course must lie below the server's root.
    (folder / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        f"c.CourseDirectory.root = {str(course.root)!r}\n"
        f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
        f"c.CourseDirectory.db_url = {course.db_url!r}\n"
        f"c.Exchange.root = {str(folder / 'exchange')!r}\n")
    with _serving(LabServer.formgrader(folder)) as lab_server:
        yield lab_server, course


@pytest.fixture(scope="module")
def make_lab(demo, tmp_path_factory):
    """`make lab` on a copy of the demo course's build (every lab's release, the student package):
    the server, the course and the working folder."""
    folder = tmp_path_factory.mktemp("make-lab")
    course = copy_build(demo[LAB].course, folder / "course")
    with _serving(LabServer.make_lab(folder, course)) as lab_server:
        yield lab_server, course, folder / "work"


class Offline:
    """Every request of a browser context that leaves this machine is refused and noted: pages
    may load files, data and what the loopback servers serve, nothing else."""

    LOCAL = ("file:", "data:", "blob:", "http://127.0.0.1:", "ws://127.0.0.1:")

    def __init__(self, context):
        self.refused: list[str] = []
        context.route("**/*", self._route)

    def _route(self, route):
        if route.request.url.startswith(self.LOCAL):
            route.continue_()
        else:
            self.refused.append(route.request.url)
            route.abort()


def _context(browser, token: str | None = None):
    # The token on every request, the page's own API calls included (formgrader's tables are loaded
    # by script, which a token in the page's URL would not cover).
    headers = {"Authorization": f"token {token}"} if token else {}
    context = browser.new_context(viewport={"width": 1400, "height": 900}, extra_http_headers=headers)
    context.set_default_timeout(PAGE_TIMEOUT_MS)
    return context, Offline(context)


@pytest.fixture
def page(browser, server):
    context, offline = _context(browser, server[0].token)
    yield context.new_page()
    context.close()
    assert offline.refused == [], "the page asked for something off this machine"


@pytest.fixture
def lab_page(browser, make_lab):
    context, offline = _context(browser, make_lab[0].token)
    yield context.new_page()
    context.close()
    assert offline.refused == [], "JupyterLab asked for something off this machine"


@pytest.fixture
def file_page(browser):
    context, offline = _context(browser)
    yield context.new_page(), offline
    context.close()


def _shot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=False)


def _hidden_test_lines(course) -> set[str]:
    source = nbformat.read(course.source(LAB), as_version=4)
    lines = set()
    for cell in source.cells:
        for region in re.findall(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", cell.source, re.S):
            lines |= {ln.strip() for ln in region.splitlines() if len(ln.strip()) > 12}
    assert lines, f"{LAB}'s source has no hidden tests to look for"
    return lines


def _run_cell(page, cell, attempts: int = 3) -> None:
    """Shift+Enter in ``cell`` until its prompt shows it queued or run. A key pressed while the
    notebook is still settling (focus moved by a late render) can be lost, seen once in several
    runs on a busy machine; the prompt, not a fixed sleep, tells whether it arrived."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    prompt = cell.locator(".jp-InputPrompt")
    for _ in range(attempts):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            page.wait_for_function("p => /\\[(\\*|\\d+)\\]/.test(p.textContent)", arg=prompt.element_handle(),
                                   timeout=20_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the cell never started after {attempts} Shift+Enter presses: {prompt.inner_text()!r}")


def test_make_lab_opens_a_lab_in_the_course_kernel_with_nothing_in_the_way(lab_page, make_lab):
    page = lab_page
    lab_server, course, work = make_lab
    assert (work / f"{LAB}.ipynb").is_file(), f"`autograder lab` made no working copy: {lab_server.tail()}"
    page.goto(lab_server.url(f"lab/tree/{LAB}.ipynb"))
    # The kernel starts by itself: nothing is clicked. A "Select Kernel" dialog would stop it, so
    # whichever comes first ends the wait.
    idle = ".jp-Notebook-ExecutionIndicator[data-status='idle']"
    page.locator(f"{idle}, .jp-Dialog").first.wait_for(timeout=KERNEL_TIMEOUT_MS)
    # JupyterLab puts its news question up once the page is restored, about when the kernel starts.
    page.wait_for_timeout(3000)
    _shot(page, "lab-opened")
    dialogs = page.locator(".jp-Dialog")
    assert dialogs.count() == 0, f"a dialog is in the way: {dialogs.first.inner_text()!r}"
    # Started: idle again once its first requests are answered (on a busy machine the indicator
    # may pass through busy or connecting first).
    page.locator(idle).wait_for(timeout=KERNEL_TIMEOUT_MS)
    kernel = page.locator(".jp-NotebookPanel-toolbar .jp-Toolbar-kernelName").first.inner_text().strip()
    assert kernel == selfstudy.KERNEL_DISPLAY
    toasts = page.locator(".Toastify__toast")
    assert toasts.count() == 0, f"a notification is up: {toasts.all_inner_texts()}"
    # Self-study has no nbgrader list to open (no course), so no Nbgrader menu at all.
    menus = [label.strip() for label in page.locator(".lm-MenuBar-itemLabel").all_inner_texts()]
    assert "Kernel" in menus and "Nbgrader" not in menus, menus

    first = page.locator(".jp-NotebookPanel .jp-CodeCell").first
    # The editor fills in after the cell appears: wait for its text rather than read it at once.
    first.locator(".jp-InputArea-editor", has_text="device.describe()").wait_for(timeout=KERNEL_TIMEOUT_MS)
    _run_cell(page, first)
    output = first.locator(".jp-OutputArea-output").first
    output.wait_for(timeout=KERNEL_TIMEOUT_MS)
    assert "torch" in output.inner_text() and "profile" in output.inner_text()

    page.locator("[title='Validate Assignment']").first.click()
    dialog = page.locator(".jp-Dialog")
    dialog.locator("#validation-message").wait_for(timeout=KERNEL_TIMEOUT_MS)
    _shot(page, "lab-validate")
    assert dialog.locator(".jp-Dialog-header").inner_text().strip() == "Validation Results"
    message = dialog.locator("#validation-message")
    # The release is unanswered: its first graded cell stops at the stub the student replaces.
    assert "validation-failed" in message.get_attribute("class")
    text = message.inner_text()
    assert "The following cell failed" in text and "NotImplementedError" in text
    assert not [line for line in _hidden_test_lines(course) if line in text]


def test_formgrader_lists_submissions_with_the_engines_scores(page, server):
    lab_server, course = server
    page.goto(lab_server.url(f"formgrader/manage_submissions/{LAB}"))
    rows = page.locator("#main-table tr")
    rows.filter(has_text="reference").wait_for()
    _shot(page, "formgrader-submissions")
    engine_totals = {}
    for row in pipeline.report_rows(course):
        if row["lab"] == LAB:
            engine_totals[row["student"]] = engine_totals.get(row["student"], 0.0) + float(row["score"])
    assert engine_totals.get("reference", 0) > 0 and len(set(engine_totals.values())) > 1
    for student, total in engine_totals.items():
        cells = rows.filter(has=page.locator("td.student-id", has_text=student)).first.locator("td")
        shown = re.search(r"([0-9.]+)\s*/\s*([0-9.]+)", cells.nth(4).inner_text())
        assert shown, f"{student}: no score in formgrader's row: {cells.nth(4).inner_text()!r}"
        assert float(shown.group(1)) == pytest.approx(total, abs=0.01), f"{student}: formgrader and engine differ"


def test_feedback_page_renders_math_offline_without_hidden_tests(file_page, server):
    page, offline = file_page
    _, course = server
    html_file = course.feedback_dir(FEEDBACK_STUDENT, LAB) / f"{LAB}.html"
    # From the file system, as a student opens a released feedback file, with the network cut off.
    page.goto(html_file.as_uri())
    page.locator("body").wait_for()
    # An equation of lab 00's roofline section, drawn as MathML: a box of its own, no TeX left.
    paragraph = page.locator("p", has_text="arithmetic intensity").first
    # Its text is the DOM's text content (MathML elements have no innerText): I=F/B.
    equation = paragraph.locator("math").filter(has_text=re.compile(r"^I=F/B$")).first
    equation.scroll_into_view_if_needed()
    _shot(page, "feedback-math")
    box = equation.bounding_box()
    assert box and box["width"] > 0 and box["height"] > 0, box
    assert "$" not in paragraph.inner_text()
    assert offline.refused == [] and page.locator("script").count() == 0
    page.evaluate("window.scrollTo(0, 0)")
    _shot(page, "feedback")
    text = page.locator("body").inner_text()
    assert "Autograder verdict for" in text
    failed = [r for r in pipeline.report_rows(course)
              if r["lab"] == LAB and r["student"] == FEEDBACK_STUDENT and r["status"] != "passed"]
    assert failed and all(f"Autograder verdict for '{r['item']}'" in text for r in failed)
    assert "HIDDEN TESTS" not in text
    assert not [line for line in _hidden_test_lines(course) if line in text], "the feedback shows hidden tests"
