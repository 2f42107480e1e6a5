"""OCI archives written from folders: what `ctr images import` reads."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest

from release import oci


def _read(tar: tarfile.TarFile, name: str) -> bytes:
    member = tar.extractfile(name)
    assert member is not None
    return member.read()


def test_archive_names_the_image_and_every_blob_matches_its_digest(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "tool").write_text("#!/bin/sh\n")
    (rootfs / "link").symlink_to("bin/tool")
    layer = oci.write_layer(rootfs, tmp_path / "layer.tar")
    dest = tmp_path / "image.tar"
    config = oci.ImageConfig(entrypoint=("/bin/tool",), env={"A": "1"})
    digest = oci.write_archive(dest, "local.test/x:1", [layer], config)

    with tarfile.open(dest) as tar:
        index = json.loads(_read(tar, "index.json"))
        (entry,) = index["manifests"]
        assert entry["digest"] == digest
        assert entry["annotations"][oci.CONTAINERD_NAME] == "local.test/x:1"
        assert entry["annotations"][oci.REF_NAME] == "1"
        manifest = json.loads(_read(tar, f"blobs/sha256/{digest.split(':')[1]}"))
        blobs = [manifest["config"], *manifest["layers"]]
        for blob in blobs:
            data = _read(tar, f"blobs/sha256/{blob['digest'].split(':')[1]}")
            assert "sha256:" + hashlib.sha256(data).hexdigest() == blob["digest"]
            assert len(data) == blob["size"]
        image_config = json.loads(_read(tar, f"blobs/sha256/{blobs[0]['digest'].split(':')[1]}"))
        assert image_config["rootfs"]["diff_ids"] == [layer.digest]
        assert image_config["config"]["Entrypoint"] == ["/bin/tool"]
        assert image_config["config"]["Env"] == ["A=1"]


def test_layers_are_reproducible(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    (rootfs / "f").write_text("x")
    first = oci.write_layer(rootfs, tmp_path / "a.tar")
    (rootfs / "f").touch()  # a new mtime must not change the layer
    second = oci.write_layer(rootfs, tmp_path / "b.tar")
    assert first.digest == second.digest
    with tarfile.open(first.path) as tar:
        assert all(m.uid == 0 and m.mtime == 0 for m in tar.getmembers())


def test_a_name_without_tag_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tag"):
        oci.write_archive(tmp_path / "x.tar", "local.test/x", [], oci.ImageConfig())


def test_an_index_archive_names_one_image_per_platform(tmp_path: Path) -> None:
    """The multi-platform archive: index.json names an image index (not a manifest), whose
    manifests carry their platform; each platform's config says its architecture, and a
    layer both platforms share is stored once."""
    images = []
    shared_root = tmp_path / "shared"
    shared_root.mkdir()
    (shared_root / "common").write_text("same on every platform")
    shared = oci.write_layer(shared_root, tmp_path / "shared.tar")
    for arch in ("amd64", "arm64"):
        rootfs = tmp_path / arch
        rootfs.mkdir()
        (rootfs / "arch").write_text(arch)
        layer = oci.write_layer(rootfs, tmp_path / f"{arch}.tar")
        images.append(oci.PlatformImage(arch, [shared, layer], oci.ImageConfig(cmd=("x",))))
    dest = tmp_path / "index.tar"
    digest = oci.write_index_archive(dest, "local.test/x:2", images)

    with tarfile.open(dest) as tar:
        (entry,) = json.loads(_read(tar, "index.json"))["manifests"]
        assert entry["mediaType"] == oci.INDEX_MEDIA_TYPE
        assert entry["digest"] == digest
        assert entry["annotations"][oci.CONTAINERD_NAME] == "local.test/x:2"
        data = _read(tar, f"blobs/sha256/{digest.split(':')[1]}")
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest
        index = json.loads(data)
        assert index["mediaType"] == oci.INDEX_MEDIA_TYPE
        platforms = [m["platform"] for m in index["manifests"]]
        assert platforms == [
            {"architecture": "amd64", "os": "linux"},
            {"architecture": "arm64", "os": "linux"},
        ]
        for descriptor in index["manifests"]:
            manifest = json.loads(_read(tar, f"blobs/sha256/{descriptor['digest'].split(':')[1]}"))
            config = json.loads(
                _read(tar, f"blobs/sha256/{manifest['config']['digest'].split(':')[1]}")
            )
            assert config["architecture"] == descriptor["platform"]["architecture"]
            assert manifest["layers"][0]["digest"] == shared.digest
        names = tar.getnames()
        assert names.count(f"blobs/sha256/{shared.digest.split(':')[1]}") == 1
    again = oci.write_index_archive(tmp_path / "again.tar", "local.test/x:2", images)
    assert again == digest


def test_an_index_needs_distinct_platforms(tmp_path: Path) -> None:
    image = oci.PlatformImage("arm64", [], oci.ImageConfig())
    with pytest.raises(ValueError, match=r"distinct platforms; got \['arm64', 'arm64'\]"):
        oci.write_index_archive(tmp_path / "x.tar", "local.test/x:1", [image, image])
