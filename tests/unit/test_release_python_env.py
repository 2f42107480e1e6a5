"""The image's dependency folder describes only what it ships: each RECORD keeps the lines of
files inside site-packages and loses those of console scripts outside it, whose hashes
depend on the path of the environment that installed them."""

from __future__ import annotations

from pathlib import Path

from release.python_env import records_inside


def test_records_keep_only_files_inside_the_site(tmp_path: Path) -> None:
    info = tmp_path / "idna-3.21.dist-info"
    info.mkdir()
    inside = "idna/__init__.py,sha256=abc,849\nidna-3.21.dist-info/RECORD,,\n"
    (info / "RECORD").write_text("../../bin/idna,sha256=rUNq,166\n" + inside)
    untouched = tmp_path / "six-1.17.0.dist-info"
    untouched.mkdir()
    (untouched / "RECORD").write_text("six.py,sha256=x,1\n")
    records_inside(tmp_path)
    assert (info / "RECORD").read_text() == inside
    assert (untouched / "RECORD").read_text() == "six.py,sha256=x,1\n"
