"""The flexgpu image the release publishes is the one release/ builds for the tests: two
builds from empty layer caches give the same manifest digest, and the image holds what the
daemons run (the project's packages and console scripts, Debian's Python, NVIDIA's CDI
programs, the controller's user)."""

from __future__ import annotations

import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from release import image as build
from release.push import manifest_digest

pytestmark = pytest.mark.integration


def _fresh_cache(tmp: Path, shared: Path) -> Path:
    """An empty image cache that shares only what is not image layout: the .deb downloads
    (apt's candidates, by name and version) and the shipped Go programs (hooks/'s
    cache, keyed by its module pins)."""
    tmp.mkdir()
    for entry in shared.glob("hooks-*"):
        (tmp / entry.name).symlink_to(entry)
    (tmp / "images").mkdir()
    (tmp / "images" / "debs").symlink_to(shared / "images" / "debs", target_is_directory=True)
    return tmp


def test_two_builds_from_empty_caches_give_the_same_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fills the shared .deb and toolkit caches. Its archive is not compared: other trees on
    # the machine prune the shared image cache as they build.
    build.flexgpu_image()
    shared = build.cache_root().parent
    digests = []
    for run in ("a", "b"):
        monkeypatch.setenv("FLEXGPU_CACHE", str(_fresh_cache(tmp_path / run, shared)))
        image = build.flexgpu_image()
        assert image.archive.is_relative_to(tmp_path / run)
        digests.append(manifest_digest(str(image.archive)))
    assert digests[0] == digests[1], digests


def _files(archive: Path) -> tuple[dict[str, object], set[str], dict[str, bytes]]:
    """The image config, every path in its layers and a few files' contents."""
    wanted = {"etc/passwd", "usr/local/lib/python3.11/dist-packages/flexgpu/driver/version.py"}
    paths: set[str] = set()
    contents: dict[str, bytes] = {}
    with tarfile.open(archive) as tar:
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        digest = index["manifests"][0]["digest"].split(":")[1]
        manifest = json.loads(tar.extractfile(f"blobs/sha256/{digest}").read())  # type: ignore[union-attr]
        config_name = f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}"
        config = json.loads(tar.extractfile(config_name).read())  # type: ignore[union-attr]
        for layer in manifest["layers"]:
            blob = tar.extractfile(f"blobs/sha256/{layer['digest'].split(':')[1]}")
            with tarfile.open(fileobj=blob) as inner:
                for member in inner:
                    paths.add(member.name)
                    if member.name in wanted and member.isfile():
                        contents[member.name] = inner.extractfile(member).read()  # type: ignore[union-attr]
    return config, paths, contents


def test_the_image_holds_what_both_daemons_run() -> None:
    image = build.flexgpu_image()
    config, paths, contents = _files(image.archive)
    bin_dir = "usr/local/bin"
    for program in ("flexgpu-kubelet-plugin", "flexgpu-controller", "flexgpu", "kubectl-flexgpu"):
        assert f"{bin_dir}/{program}" in paths, program
    # The plugin runs flexgpu-cdi-common at start and installs nvidia-cdi-hook for its specs.
    for program in build.TOOLKIT_PROGRAMS:
        assert f"{bin_dir}/{program}" in paths, program
    assert "usr/bin/python3.11" in paths
    site = "usr/local/lib/python3.11/dist-packages"
    for pkg in ("driver", "kubelet_plugin", "controller"):
        assert f"{site}/flexgpu/{pkg}/__init__.py" in paths, pkg
    for dependency in ("kubernetes", "grpc", "pydantic", "kopf", "pynvml.py"):
        assert any(p.startswith(f"{site}/{dependency}") for p in paths), dependency
    assert not any(p.endswith(".pyc") for p in paths)
    assert b"flexgpu:x:65532:65532:" in contents["etc/passwd"]
    cfg = config["config"]
    assert isinstance(cfg, dict)
    assert cfg["Cmd"] == ["flexgpu-controller"]
    version = contents[f"{site}/flexgpu/driver/version.py"].decode()
    assert f'VERSION: Final = "{cfg["Labels"]["org.opencontainers.image.version"]}"' in version
    assert config["created"] == "1970-01-01T00:00:00Z"
    assert os.path.basename(str(image.archive)).startswith("flexgpu-")


def test_the_image_names_no_path_of_the_machine_that_built_it() -> None:
    """Where the checkout and its environment lie must not show in the image, or its digest
    would depend on them (the layers are cached under keys of their inputs, which do not
    hold those paths). The dependencies' RECORD files listed console scripts, whose
    shebang names the building environment's interpreter."""
    image = build.flexgpu_image()
    paths = {os.fsencode(p) for p in (sys.prefix, str(build.REPO))}
    found: list[str] = []
    with tarfile.open(image.archive) as outer:
        for layer in (
            m for m in outer.getmembers() if m.name.startswith("blobs/") and m.size > 4096
        ):
            with tarfile.open(fileobj=outer.extractfile(layer)) as inner:
                for member in inner.getmembers():
                    if not member.isfile():
                        continue
                    data = inner.extractfile(member).read()  # type: ignore[union-attr]
                    found += [f"{member.name}: {p!r}" for p in paths if p in data]
    assert not found, found[:10]
