"""nbgrader's gradebook on PostgreSQL: how the URL is chosen and shown, a server that does not
answer, and lab 00 graded into a real PostgreSQL server that this file starts on loopback."""

import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from autograder import cli, gradebook, pipeline, profiles
from autograder.course import Course, build, copy_build, write_config
from autograder.engine.items import load_lab
from autograder.submissions import make_submission, reference_solutions

LAB = "00_measure"
SECRET = "hunter2"  # a password: no message, repr or error may show it


def free_port() -> int:
    """A loopback port nobody listens on (once this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_url_comes_from_the_argument_then_the_environment_then_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv(gradebook.URL_VAR, raising=False)
    assert Course(tmp_path).db_url == f"sqlite:///{tmp_path.resolve() / 'gradebook.db'}"
    url = f"postgresql://grader:{SECRET}@db.example:5432/course"
    monkeypatch.setenv(gradebook.URL_VAR, url)
    # SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; the project installs psycopg2.
    assert Course(tmp_path).db_url == f"postgresql+psycopg2://grader:{SECRET}@db.example:5432/course"
    assert Course(tmp_path, "sqlite:////srv/gb.db").db_url == "sqlite:////srv/gb.db"
    assert SECRET not in repr(Course(tmp_path))

    argv = ["--course", str(tmp_path), "--db-url", "postgresql://other@/db2?host=/run/postgresql", "report", "--csv", "x"]
    assert cli._course(cli.parser().parse_args(argv)).db_url == "postgresql+psycopg2://other@/db2?host=/run/postgresql"

    # nbgrader's own commands read the URL from the course's config; with a password in it,
    # only the owner may read that file.
    write_config(Course(tmp_path))
    config = tmp_path / "nbgrader_config.py"
    assert f"c.CourseDirectory.db_url = {Course(tmp_path).db_url!r}" in config.read_text()
    assert config.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://grader:{SECRET}@db.example/course", "postgresql://grader:***@db.example/course"),
    (f"postgresql://grader@db.example/course?password={SECRET}&sslmode=require",
     "postgresql://grader@db.example/course?password=***&sslmode=require"),
    ("postgresql://grader@/course?host=/run/postgresql", "postgresql://grader@/course?host=/run/postgresql"),
    ("postgresql:///course?host=/run/postgresql&port=5433", "postgresql:///course?host=/run/postgresql&port=5433"),
    ("sqlite:////srv/course/gradebook.db", "sqlite:////srv/course/gradebook.db"),
    (f"not a url://grader:{SECRET}@host/db", "not a url://grader:***@host/db"),
])
def test_a_shown_url_has_its_password_masked(url, shown):
    assert gradebook.masked(url) == shown


def test_a_server_that_does_not_answer_stops_the_command_before_any_work(tmp_path, capsys):
    url = f"postgresql://grader:{SECRET}@127.0.0.1:{free_port()}/course"
    with pytest.raises(gradebook.GradebookUnavailable) as raised:
        Course(tmp_path, url).check_gradebook()
    message = str(raised.value)
    assert message.startswith("cannot reach the gradebook at postgresql+psycopg2://grader:***@127.0.0.1:")
    assert "Connection refused" in message and SECRET not in message

    assert cli.main(["--course", str(tmp_path / "course"), "--db-url", url, "build", LAB]) == 2
    shown = capsys.readouterr().err
    assert "cannot reach the gradebook" in shown and SECRET not in shown
    assert not (tmp_path / "course").exists()


def test_a_missing_driver_is_named():
    with pytest.raises(gradebook.GradebookUnavailable, match="driver is missing: No module named 'pg8000'"):
        gradebook.check(f"postgresql+pg8000://grader:{SECRET}@127.0.0.1/course")


def test_a_copy_keeps_a_sqlite_gradebook_of_its_own(tmp_path, monkeypatch):
    # The environment names a shared database: the copy must still not write into it.
    monkeypatch.setenv(gradebook.URL_VAR, f"postgresql://grader:{SECRET}@db.example/course")
    course = Course(tmp_path / "course", f"sqlite:///{tmp_path / 'kept' / 'grades.db'}")
    for part in ("source", "release", "student_package"):
        (course.root / part).mkdir(parents=True)
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "grades.db").write_bytes(b"the source gradebook")
    copy = copy_build(course, tmp_path / "copy")
    assert copy.db_url == f"sqlite:///{(tmp_path / 'copy').resolve() / 'gradebook.db'}"
    assert (copy.root / "gradebook.db").read_bytes() == b"the source gradebook"
    assert repr(copy.db_url) in (copy.root / "nbgrader_config.py").read_text()


def _server_binaries() -> Path | None:
    found = glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")
    if not found:
        return None
    newest = max(found, key=lambda p: [int(x) for x in Path(p).parent.parent.name.split(".") if x.isdigit()])
    return Path(newest).parent


@dataclass
class Server:
    socket_dir: Path
    port: int

    def create_database(self, name: str) -> tuple[str, str]:
        """A new, empty database: its URL through the unix socket, and through loopback TCP."""
        import psycopg2

        connection = psycopg2.connect(host=str(self.socket_dir), port=self.port, user="postgres", dbname="postgres")
        connection.autocommit = True  # CREATE DATABASE refuses to run inside a transaction
        try:
            connection.cursor().execute(f'CREATE DATABASE "{name}"')
        finally:
            connection.close()
        return (f"postgresql://postgres@/{name}?host={self.socket_dir}&port={self.port}",
                f"postgresql://postgres@127.0.0.1:{self.port}/{name}")


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this session: loopback and a unix socket, trust authentication."""
    root = os.geteuid() == 0
    if _server_binaries() is None and root and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "postgresql"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=900)
            subprocess.run(install, env=env, capture_output=True, timeout=900)
    bin_dir = _server_binaries()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server: nothing in /usr/lib/postgresql/<version>/bin, and it could not be "
                    "installed here (apt-get install postgresql needs root and apt-get)")
    if root:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("the PostgreSQL server refuses root and there is no postgres user to run it as")
    # The server runs as the postgres user, which cannot pass through pytest's temporary folders
    # (private to the user running the tests): its own folder is made in /tmp.
    base = Path(tempfile.mkdtemp(prefix="fastdl-pg-"))
    as_server = []
    if root:
        shutil.chown(base, "postgres", "postgres")
        as_server = ["runuser", "-u", "postgres", "--"]
    data, port = base / "data", free_port()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*as_server, *argv], capture_output=True, text=True, timeout=120)

    pg_ctl = str(bin_dir / "pg_ctl")
    try:
        done = run(str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8")
        assert done.returncode == 0, done.stdout + done.stderr
        options = f"-h 127.0.0.1 -p {port} -k {base} -c fsync=off"
        done = run(pg_ctl, "-D", str(data), "-l", str(base / "server.log"), "-o", options, "-w", "start")
        assert done.returncode == 0, done.stdout + done.stderr + (base / "server.log").read_text()
        yield Server(base, port)
    finally:
        run(pg_ctl, "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_a_lab_graded_on_postgresql_lands_in_its_database(postgres, tmp_path, monkeypatch):
    # nbgrader runs `alembic` by name when it makes a new gradebook (the Makefile does the same).
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    _, tcp_url = postgres.create_database("course")
    # Only the grader's own process writes the gradebook: a server reached over TCP works as well
    # as through its socket.
    course = Course(tmp_path / "course", tcp_url)
    course.check_gradebook()
    build(course, [LAB])
    make_submission(course, LAB, "reference", reference_solutions(course, LAB))
    make_submission(course, LAB, "untouched", None)
    # The engine alone: nbgrader's run of the notebook (its own scratch gradebook) is not what is tested here.
    summary = pipeline.autograde(course, load_lab(LAB), profile=profiles.load("cpu"), seed=1234,
                                 students=["reference", "untouched"], execute=False)
    assert summary.failures == []

    totals = pipeline.totals(pipeline.report_rows(course))
    full = totals[("reference", LAB)]["max"]
    assert full > 0 and totals[("reference", LAB)]["score"] == full
    with Gradebook(gradebook.with_driver(tcp_url)) as gb:
        assert gb.find_submission(LAB, "reference").score == full
        assert gb.find_submission(LAB, "untouched").score == 0
        assert gb.find_submission(LAB, "untouched").max_score == gb.find_submission(LAB, "reference").max_score
    assert not [p for p in course.root.rglob("*") if p.suffix in (".db", ".sqlite")]

    # A copy (a worker's, a trial's) gets the rows in a SQLite file of its own.
    copy = copy_build(course, tmp_path / "copy")
    assert copy.db_url == copy.sqlite_url
    with Gradebook(copy.db_url) as gb:
        assert [a.name for a in gb.assignments] == [LAB]
        assert gb.find_submission(LAB, "reference").score == full
