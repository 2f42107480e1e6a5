"""Writes container images as OCI image-layout archives (what `ctr images import` reads),
from plain folders, without a registry or an image builder. Layers are reproducible: entries
sorted, owned by root, dated at the epoch."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
# containerd names an imported image after this annotation (the full reference).
CONTAINERD_NAME = "io.containerd.image.name"
REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class Layer:
    """An uncompressed layer tar on disk; its digest is also its diff ID."""

    path: Path
    digest: str
    size: int


@dataclass(frozen=True)
class ImageConfig:
    entrypoint: Sequence[str] = ()
    cmd: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    user: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _normalise(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    return info


def write_layer(rootfs: Path, dest: Path) -> Layer:
    """Tars ``rootfs`` (its contents, not the folder itself) into ``dest``."""
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            base = Path(dirpath)
            for name in sorted(dirnames) + sorted(filenames):
                full = base / name
                arcname = str(full.relative_to(rootfs))
                info = tar.gettarinfo(str(full), arcname)
                _normalise(info)
                if info.isreg():
                    with full.open("rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
            # os.walk does not descend into symlinked folders; they are added as links above.
            dirnames[:] = [d for d in dirnames if not (base / d).is_symlink()]
    os.replace(tmp, dest)
    return Layer(dest, _sha256_file(dest), dest.stat().st_size)


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = _normalise(tarfile.TarInfo(name))
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _image_blobs(
    layers: Sequence[Layer], config: ImageConfig, architecture: str
) -> tuple[list[tuple[str, bytes]], dict[str, Any]]:
    """The config and manifest blobs of one image; returns them (manifest last) and the
    manifest's descriptor with its platform."""
    cfg: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in config.env.items()],
        "WorkingDir": config.working_dir,
    }
    if config.entrypoint:
        cfg["Entrypoint"] = list(config.entrypoint)
    if config.cmd:
        cfg["Cmd"] = list(config.cmd)
    if config.user:
        cfg["User"] = config.user
    if config.labels:
        cfg["Labels"] = dict(config.labels)
    image_config = {
        "architecture": architecture,
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in layers]},
    }
    config_digest, config_bytes = _blob(json.dumps(image_config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {
            "mediaType": CONFIG_MEDIA_TYPE,
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    descriptor = {
        "mediaType": MANIFEST_MEDIA_TYPE,
        "digest": manifest_digest,
        "size": len(manifest_bytes),
        "platform": {"architecture": architecture, "os": "linux"},
    }
    return [(config_digest, config_bytes), (manifest_digest, manifest_bytes)], descriptor


@dataclass(frozen=True)
class PlatformImage:
    """One platform's image in a multi-platform archive."""

    architecture: str
    layers: Sequence[Layer]
    config: ImageConfig


def write_archive(
    dest: Path, name: str, layers: Sequence[Layer], config: ImageConfig, architecture: str = "amd64"
) -> str:
    """Writes an OCI layout archive holding one linux image named ``name`` (a full
    reference such as ``registry.k8s.io/pause:3.10.2``). Returns the manifest digest."""
    _check_name(name)
    blobs, descriptor = _image_blobs(layers, config, architecture)
    _write_layout(dest, name, descriptor, blobs, layers)
    return str(descriptor["digest"])


def write_index_archive(dest: Path, name: str, images: Sequence[PlatformImage]) -> str:
    """Writes an OCI layout archive whose ``name`` is an image index over one image per
    platform (what a registry serves to amd64 and arm64 nodes alike). Returns the index's
    digest, the one a pull by digest names."""
    _check_name(name)
    architectures = [image.architecture for image in images]
    if not images or len(set(architectures)) != len(architectures):
        raise ValueError(f"an image index needs distinct platforms; got {architectures}")
    blobs: list[tuple[str, bytes]] = []
    descriptors: list[dict[str, Any]] = []
    layers: dict[str, Layer] = {}
    for image in images:
        image_blobs, descriptor = _image_blobs(image.layers, image.config, image.architecture)
        blobs += image_blobs
        descriptors.append(descriptor)
        layers.update({layer.digest: layer for layer in image.layers})
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": descriptors}
    index_digest, index_bytes = _blob(json.dumps(index, sort_keys=True).encode())
    blobs.append((index_digest, index_bytes))
    top = {"mediaType": INDEX_MEDIA_TYPE, "digest": index_digest, "size": len(index_bytes)}
    _write_layout(dest, name, top, blobs, list(layers.values()))
    return index_digest


def _check_name(name: str) -> None:
    if ":" not in name.rsplit("/", 1)[-1]:
        raise ValueError(f"image name {name!r} has no tag; expected <repository>:<tag>")


def _write_layout(
    dest: Path,
    name: str,
    top: dict[str, Any],
    blobs: Sequence[tuple[str, bytes]],
    layers: Sequence[Layer],
) -> None:
    """The archive: index.json naming ``top`` (a manifest or an index), then the blobs."""
    entry = {**top, "annotations": {CONTAINERD_NAME: name, REF_NAME: name.rsplit(":", 1)[1]}}
    index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": [entry]}
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add_bytes(tar, "index.json", json.dumps(index, sort_keys=True).encode())
        for digest, data in blobs:
            _add_bytes(tar, f"blobs/sha256/{digest.split(':', 1)[1]}", data)
        for layer in layers:
            info = _normalise(tarfile.TarInfo(f"blobs/sha256/{layer.digest.split(':', 1)[1]}"))
            info.size = layer.size
            info.mode = stat.S_IMODE(0o644)
            with layer.path.open("rb") as f:
                tar.addfile(info, f)
    os.replace(tmp, dest)
