import os
from pathlib import Path

import pytest

from flexgpu.driver.atomic_file import atomic_write_bytes, atomic_write_text


def test_writes_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "state.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert os.stat(target).st_mode & 0o777 == 0o644
    # No temp files are left behind.
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def test_failed_write_keeps_old_content_and_cleans_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "state.json"
    atomic_write_bytes(target, b"old")

    def broken_replace(src: str, dst: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_mode_is_applied(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    atomic_write_bytes(target, b"x", mode=0o600)
    assert os.stat(target).st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, ["file", "directory"]),
        ({"sync_directory": False}, ["file"]),
        ({"sync_data": False}, []),
    ],
)
def test_syncs_follow_the_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, bool], expected: list[str]
) -> None:
    target = tmp_path / "state.json"
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append("directory" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    atomic_write_bytes(target, b"new", **options)
    assert target.read_bytes() == b"new"
    assert synced == expected
