import pytest

from autograder.strip import STUB, MarkerError, strip_package, strip_solutions

SOURCE = '''def f(x):
    """Doc."""
    ### BEGIN SOLUTION
    secret = x * 2
    return secret
    ### END SOLUTION


def g():
    return 1
'''


def test_region_becomes_indented_stub():
    out = strip_solutions(SOURCE)
    assert "secret" not in out and "BEGIN SOLUTION" not in out
    assert f"    {STUB}\n" in out
    assert "def g():\n    return 1" in out
    compile(out, "<stripped>", "exec")


@pytest.mark.parametrize("bad", [
    "### END SOLUTION\n",
    "### BEGIN SOLUTION\nx = 1\n",
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n",
])
def test_unbalanced_markers_are_refused(bad):
    with pytest.raises(MarkerError):
        strip_solutions(bad, where="m.py")


def test_package_copy(tmp_path):
    src = tmp_path / "pkg"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text(SOURCE)
    (src / "sub" / "b.py").write_text("x = 1\n")
    stripped = strip_package(src, tmp_path / "out")
    assert [p.name for p in stripped] == ["a.py"]
    assert (tmp_path / "out" / "sub" / "b.py").read_text() == "x = 1\n"
