"""The image push the release and the real-node tests share (release/push.py), against
the local registry built from distribution's module (tools/registry): what the registry then
serves is the archive's manifest, byte for byte, under the archive's digest."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from release import oci
from release.push import PushError, manifest_digest, push
from tools.registry.server import LocalRegistry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(tmp_path_factory.mktemp("registry"))
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


def _archive(tmp_path: Path, text: str) -> Path:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "hello").write_text(text)
    layer = oci.write_layer(rootfs, tmp_path / "layer.tar")
    dest = tmp_path / "image.tar"
    oci.write_archive(dest, "example.test/hello:1", [layer], oci.ImageConfig(cmd=("/bin/true",)))
    return dest


def _get(url: str, accept: str = oci.MANIFEST_MEDIA_TYPE) -> tuple[bytes, dict[str, str]]:
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read(), dict(resp.headers)


def test_push_stores_the_archives_manifest_under_its_digest(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    archive = _archive(tmp_path, "one")
    digest = manifest_digest(str(archive))
    ref = push(str(archive), f"{registry.address}/flexgpu/hello:v1")
    assert ref == f"{registry.address}/flexgpu/hello@{digest}"

    base = f"http://{registry.address}/v2/flexgpu/hello"
    by_tag, headers = _get(f"{base}/manifests/v1")
    assert "sha256:" + hashlib.sha256(by_tag).hexdigest() == digest
    assert headers["Docker-Content-Digest"] == digest
    by_digest, _ = _get(f"{base}/manifests/{digest}")
    assert by_digest == by_tag
    # Every blob the manifest names is served, with the content its digest says.
    manifest = json.loads(by_tag)
    for desc in [manifest["config"], *manifest["layers"]]:
        blob, _ = _get(f"{base}/blobs/{desc['digest']}", "*/*")
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == desc["digest"]
        assert len(blob) == desc["size"]


def test_a_second_push_reuses_blobs_and_a_new_tag_names_the_same_digest(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    archive = _archive(tmp_path, "two")
    first = push(str(archive), f"{registry.address}/flexgpu/hello:a")
    second = push(str(archive), f"{registry.address}/flexgpu/hello:b")
    assert first == second
    tags, _ = _get(f"http://{registry.address}/v2/flexgpu/hello/tags/list", "*/*")
    assert {"a", "b"} <= set(json.loads(tags)["tags"])


def test_an_index_is_pushed_with_every_platforms_image_and_served_per_platform(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    """The release's multi-platform archive: the registry serves the index under the tag and
    the archive's digest, and each platform's manifest and blobs under their own digests."""
    images = []
    for arch in ("amd64", "arm64"):
        rootfs = tmp_path / arch
        (rootfs / "etc").mkdir(parents=True)
        (rootfs / "etc" / "arch").write_text(arch)
        layer = oci.write_layer(rootfs, tmp_path / f"{arch}.tar")
        images.append(oci.PlatformImage(arch, [layer], oci.ImageConfig(cmd=("/bin/true",))))
    archive = tmp_path / "index.tar"
    digest = oci.write_index_archive(archive, "example.test/multi:1", images)
    assert manifest_digest(str(archive)) == digest
    ref = push(str(archive), f"{registry.address}/flexgpu/multi:v1")
    assert ref == f"{registry.address}/flexgpu/multi@{digest}"

    base = f"http://{registry.address}/v2/flexgpu/multi"
    by_tag, headers = _get(f"{base}/manifests/v1", oci.INDEX_MEDIA_TYPE)
    assert "sha256:" + hashlib.sha256(by_tag).hexdigest() == digest
    assert headers["Content-Type"] == oci.INDEX_MEDIA_TYPE
    index = json.loads(by_tag)
    assert [m["platform"]["architecture"] for m in index["manifests"]] == ["amd64", "arm64"]
    for desc in index["manifests"]:
        data, _ = _get(f"{base}/manifests/{desc['digest']}")
        assert "sha256:" + hashlib.sha256(data).hexdigest() == desc["digest"]
        manifest = json.loads(data)
        for blob_desc in [manifest["config"], *manifest["layers"]]:
            blob, _ = _get(f"{base}/blobs/{blob_desc['digest']}", "*/*")
            assert "sha256:" + hashlib.sha256(blob).hexdigest() == blob_desc["digest"]


def test_bad_references_and_unreachable_registries_are_named(tmp_path: Path) -> None:
    archive = _archive(tmp_path, "three")
    with pytest.raises(PushError, match="expected <registry>/<repository>:<tag>"):
        push(str(archive), "no-tag-here")
    with pytest.raises(PushError, match=re.escape("127.0.0.1:9/v2/x/blobs")):
        push(str(archive), "127.0.0.1:9/x:1")
