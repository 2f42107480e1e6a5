"""The image's cached layers are keyed on the files they are made of: a tool cache that
outlives a Debian point release or a wheel added to the package index rebuilds the layer
instead of reusing one made from the older file (the release's digest would otherwise
depend on what the cache happened to hold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from release import debs
from release import image as build
from release.layers import BUSYBOX_DEB


def _cache_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> Path:
    """A tool cache holding one (empty) .deb per base-layer package at ``versions``
    (default 1.0): fetch() finds them and downloads nothing."""
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    folder = tmp_path / "images" / "debs"
    folder.mkdir(parents=True, exist_ok=True)
    arch = debs.host_arch()
    for pkg in (BUSYBOX_DEB, *build.PYTHON_DEBS):
        (folder / f"{pkg}_{versions.get(pkg, '1.0')}_{arch}.deb").touch()
    return folder


def test_a_newer_deb_in_the_cache_changes_the_base_layer_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cache_with(tmp_path, monkeypatch, {})
    before = build._deb_inputs(debs.host_arch())
    assert f"deb libssl3_1.0_{debs.host_arch()}.deb" in before
    # A point release's libssl3 lands next to the old one (the lexically last is used).
    _cache_with(tmp_path, monkeypatch, {"libssl3": "1.1"})
    after = build._deb_inputs(debs.host_arch())
    assert f"deb libssl3_1.1_{debs.host_arch()}.deb" in after
    assert before != after
