"""The real node's cgroup walk: it finds every cgroup.procs below the node's root, and a
cgroup removed while it walks (the runtime deletes a stopped container's) is skipped instead
of failing the node's teardown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.node import cgroups


def test_finds_every_procs_file_and_a_missing_root_is_empty(tmp_path: Path) -> None:
    for sub in ("a", "a/b", "c"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "cgroup.procs").write_text("1\n")
    found = cgroups._procs_files(tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in found) == [
        "a/b/cgroup.procs",
        "a/cgroup.procs",
        "c/cgroup.procs",
    ]
    assert cgroups._procs_files(tmp_path / "gone") == []


def test_a_cgroup_removed_during_the_walk_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "flexgpu-node-x"
    (root / "pod" / "container").mkdir(parents=True)
    (root / "kept").mkdir()
    (root / "kept" / "cgroup.procs").write_text("41\n42\n")
    real_scandir = os.scandir

    def scandir(path: str | os.PathLike[str]) -> object:
        if Path(path).name == "container":  # removed between listing "pod" and entering it
            raise FileNotFoundError(path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(cgroups, "hierarchies", lambda: [tmp_path])
    assert cgroups.pids("/flexgpu-node-x") == {41, 42}
