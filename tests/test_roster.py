"""``python -m autograder roster``: a CSV roster into the gradebook (names and all) and the hub's users."""

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from autograder import cli, roster

ROOT = Path(__file__).resolve().parent.parent
GOOD = """id,first_name,last_name,email,role
ada,Ada,Lovelace,ada@uni.example,
bob,Bob,Byte,,student
prof,Grace,Hopper,,instructor
"""


def write(tmp_path: Path, text: str, name: str = "roster.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run(tmp_path: Path, *args: str) -> int:
    return cli.main(["--course", str(tmp_path / "course"), "--db-url", f"sqlite:///{tmp_path / 'gb.db'}", *args])


def students(tmp_path: Path) -> dict[str, tuple]:
    with Gradebook(f"sqlite:///{tmp_path / 'gb.db'}", "fastdl-lab") as gb:
        return {s.id: (s.first_name, s.last_name, s.email) for s in gb.students}


def test_import_names_students_and_writes_the_hubs_users(tmp_path, capsys):
    hub = tmp_path / "hub" / "roster.json"
    assert run(tmp_path, "roster", "import", str(write(tmp_path, GOOD)), "--hub", str(hub)) == 0
    # formgrader lists students by their names, not "None, None"; instructors are not students.
    assert students(tmp_path) == {"ada": ("Ada", "Lovelace", "ada@uni.example"), "bob": ("Bob", "Byte", None)}
    users = json.loads(hub.read_text())
    assert users["students"] == ["ada", "bob"] and users["instructors"] == ["prof"]
    assert users["uids"] == {"ada": 20000, "bob": 20001, "prof": 20002}
    assert "2 student(s) in the gradebook (2 new, 0 updated), 1 instructor(s)" in capsys.readouterr().out


def test_a_later_import_keeps_every_uid_and_every_graded_student(tmp_path, capsys):
    hub = tmp_path / "roster.json"
    run(tmp_path, "roster", "import", str(write(tmp_path, GOOD)), "--hub", str(hub))
    # bob leaves, cy joins, ada's name is corrected.
    later = "id,first_name,last_name\nada,Ada,King\ncy,Cy,Clock\n"
    assert run(tmp_path, "roster", "import", str(write(tmp_path, later, "later.csv")), "--hub", str(hub)) == 0
    users = json.loads(hub.read_text())
    # bob may no longer log in, but his uid is never given to anyone else; cy gets a new one.
    assert users["students"] == ["ada", "cy"] and users["instructors"] == []
    assert users["uids"] == {"ada": 20000, "bob": 20001, "prof": 20002, "cy": 20003}
    assert students(tmp_path)["ada"] == ("Ada", "King", "ada@uni.example")
    out = capsys.readouterr().out
    assert "(1 new, 1 updated)" in out and "not on this roster, left there with their grades: bob" in out


def test_bad_rows_are_named_and_the_rest_imported(tmp_path, capsys):
    text = ("id,first_name,last_name,role\n"
            "ada,Ada,Lovelace,\n"      # line 2: fine
            "Bob,Bob,Byte,\n"          # 3: upper case
            ",No,Id,\n"                # 4: no id
            "ada,Again,Twice,\n"       # 5: duplicate
            "cy+x,C,Y,\n"              # 6: '+' breaks nbgrader's exchange names
            "dee,Dee,Dee,ta\n"         # 7: unknown role
            "eve,Eve,Extra,student,oops\n"  # 8: one field too many
            "\n"
            f"fay,{'F' * 129},Long,\n"  # 10: longer than the gradebook holds
            "gus,Gus,Good,student\n")
    assert run(tmp_path, "roster", "import", str(write(tmp_path, text))) == 1
    assert sorted(students(tmp_path)) == ["ada", "gus"]
    err = capsys.readouterr().err
    assert "7 row(s) of" in err and "(the others were)" in err
    for expected in ["line 3: id 'Bob' has upper-case letters", "write 'bob'", "line 4: no id",
                     "line 5: id 'ada' is already on line 2", "line 6: id 'cy+x' is not a name",
                     "line 7: role 'ta' is neither", "line 8: 5 fields where the header has 4",
                     "line 10: first_name is longer than the gradebook's 128 characters"]:
        assert expected in err, err


@pytest.mark.parametrize("text, reason", [
    ("", "is empty: it needs a header row"),
    ("name,first_name\nada,Ada\n", "has no 'id' column"),
    ("id,first_name,shoe_size\nada,Ada,38\n", "columns nbgrader's gradebook does not hold: shoe_size"),
])
def test_a_roster_that_cannot_be_read_stops_before_the_gradebook(tmp_path, capsys, text, reason):
    assert run(tmp_path, "roster", "import", str(write(tmp_path, text))) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "gb.db").exists()


def test_a_spreadsheets_export_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "roster.csv"
    path.write_bytes("\ufeffid,first_name,last_name\r\nada,Ada,Lovelace\r\n".encode())
    assert [p.id for p in roster.read(path).people] == ["ada"]


def test_passwd_lines_name_every_uid_for_the_grading_side(tmp_path, capsys):
    hub = tmp_path / "roster.json"
    run(tmp_path, "roster", "import", str(write(tmp_path, GOOD)), "--hub", str(hub))
    capsys.readouterr()
    assert run(tmp_path, "roster", "passwd", str(hub)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ada:x:20000:100::/nonexistent:/usr/sbin/nologin" and len(lines) == 3


def test_the_command_runs_as_printed(tmp_path):
    done = subprocess.run([sys.executable, "-m", "autograder", "--course", str(tmp_path / "course"), "roster", "import",
                           str(write(tmp_path, GOOD))], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "course" / "gradebook.db").is_file()
