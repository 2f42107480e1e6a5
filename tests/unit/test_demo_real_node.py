"""How the demo decides whether it can run its real node: the reason it prints in one line,
and that it finds `make node`'s binaries where tools/node/build.sh caches them."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo import real_node
from tools import buildcache
from tools.node import preflight


class Plane:
    def __init__(self, version: str) -> None:
        self.version = version


def test_binaries_are_found_where_build_sh_puts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    assert not real_node.binaries_built()
    # Where build.sh itself would put them (its own key, asked of the script).
    folder, complete = buildcache.entry("node")
    assert folder.parent == tmp_path and folder.name.startswith("node-") and not complete
    folder.mkdir()
    assert not real_node.binaries_built()  # a build that did not finish
    (folder / ".complete").touch()
    assert real_node.binaries_built()


def test_missing_binaries_are_named_with_the_command_that_builds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(preflight, "problems", lambda: [])
    assert real_node.missing(Plane("Kubernetes v1.37.2")) == (  # type: ignore[arg-type]
        "its binaries are not built (run `make node`)"
    )


def test_an_older_control_plane_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "problems", lambda: ["not root (euid 1000): ..."])
    reason = real_node.missing(Plane("Kubernetes v1.36.5"))  # type: ignore[arg-type]
    assert reason == (
        "not root (euid 1000): ...; the control plane is v1.36.5, older than its kubelet"
    )
