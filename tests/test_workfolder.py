"""A job's folder is removed by the job, or, when its process was killed, by the next sweep; never
while a live job holds it."""

import os
import signal
import subprocess
import sys
import textwrap

from autograder import workfolder


def test_a_held_folder_survives_a_sweep_and_goes_when_its_job_ends(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with workfolder.job_folder() as work:
        assert work.parent == tmp_path and work.name.startswith(workfolder.PREFIX)
        (work / "cell.py").write_text("x = 1\n")
        # A second job of the same process sweeps: the folder is held, so it stays.
        assert workfolder.remove_abandoned() == []
        assert (work / "cell.py").is_file()
    assert list(tmp_path.iterdir()) == []


def test_the_folder_of_a_killed_job_is_removed_by_the_next_sweep(tmp_path):
    holder = textwrap.dedent("""
        import sys, time
        from autograder import workfolder
        with workfolder.job_folder() as work:
            (work / "cell.py").write_text("x = 1\\n")
            print(work, flush=True)
            time.sleep(600)
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True, env=env)
    try:
        held = proc.stdout.readline().strip()
        assert held and os.path.isdir(held)
        assert workfolder.remove_abandoned(str(tmp_path)) == [], "its job is alive"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert os.path.isdir(held), "a killed job cannot remove its own folder"
    assert workfolder.remove_abandoned(str(tmp_path)) == [held]
    assert not os.path.exists(held)


def test_a_sweep_follows_no_link_and_leaves_other_names_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / f"{workfolder.PREFIX}link").symlink_to(elsewhere)
    (sweep / "fastdl-roofline-abc").mkdir()
    assert workfolder.remove_abandoned(str(sweep)) == []
    assert (elsewhere / "keep").exists() and (sweep / "fastdl-roofline-abc").is_dir()
