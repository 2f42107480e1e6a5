"""The release's image index: linux/amd64 and linux/arm64 built the same way (each
architecture's Debian packages, its wheels of the same dependency versions, the hooks
cross-compiled), reproducible, and the arm64 image starts: its entry points run under
qemu-user-static in a root file system unpacked from the image. The only test that builds
arm64 (the build cache keeps what it built); `make setup` builds none of it."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from release import debs, oci, wheels
from release import image as build
from release.layers import cache_root
from release.push import manifest_digest, push
from tools.images import debian_rootfs
from tools.registry.server import LocalRegistry

pytestmark = pytest.mark.integration

BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
# ELF e_machine of AArch64: what every program of the arm64 image must be built for.
EM_AARCH64 = 183


def _arm64_runs_here() -> str:
    """Why arm64 programs cannot run on this machine, or "" when they can."""
    if debs.host_arch() == "arm64":
        return ""
    if os.geteuid() != 0:
        return "chroot and mount namespaces need root"
    try:
        enabled = BINFMT.read_text().splitlines()[0] == "enabled"
    except OSError:
        enabled = False
    if not enabled:
        return (
            "no qemu-aarch64 binfmt_misc handler is registered (tools/system-deps.sh test "
            "installs qemu-user-static and registers it where /proc/sys/fs/binfmt_misc can be "
            "mounted)"
        )
    return ""


def _unpack(archive: Path, rootfs: Path) -> dict[str, Any]:
    """The image's layers unpacked into ``rootfs``; returns its platform and config."""
    rootfs.mkdir()
    with tarfile.open(archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.split(':')[1]}")
            assert member is not None
            return member

        index = tar.extractfile("index.json")
        assert index is not None
        entry = json.loads(index.read())["manifests"][0]
        manifest = json.loads(blob(entry["digest"]).read())
        config = json.loads(blob(manifest["config"]["digest"]).read())
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=blob(layer["digest"])) as inner:
                inner.extractall(rootfs, filter="tar")
    return {"platform": entry["platform"], "config": config}


def _machine(program: Path) -> int:
    header = program.read_bytes()[:20]
    assert header[:4] == b"\x7fELF", program
    return int.from_bytes(header[18:20], "little")


# Each line: a program of the image and what it must print. The daemons' --help parses their
# options without a cluster; the imports are what they load at start.
START = """
set -e
uname -m
python3 -c 'import grpc, pydantic, pynvml, kopf, kubernetes; print("imports ok")'
python3 -c 'import flexgpu.kubelet_plugin.main, flexgpu.controller.main; print("entry modules ok")'
flexgpu-kubelet-plugin --help | head -1
flexgpu-controller --help | head -1
nvidia-ctk --version | head -1
nvidia-cdi-hook --version | head -1
"""


def test_the_arm64_image_starts(tmp_path: Path) -> None:
    image = build.flexgpu_image("arm64")
    rootfs = tmp_path / "rootfs"
    found = _unpack(image.archive, rootfs)
    assert found["platform"] == {"architecture": "arm64", "os": "linux"}
    assert found["config"]["architecture"] == "arm64"
    bin_dir = rootfs / "usr" / "local" / "bin"
    for program in [rootfs / "usr" / "bin" / "python3.11", rootfs / "bin" / "busybox"] + [
        bin_dir / name for name in build.TOOLKIT_PROGRAMS
    ]:
        assert _machine(program) == EM_AARCH64, program
    site = rootfs / build.SITE_PACKAGES
    assert list(site.glob("grpc/_cython/cygrpc.cpython-311-aarch64-linux-gnu.so")), "grpc"
    assert list(site.glob("pydantic_core/_pydantic_core.cpython-311-aarch64-linux-gnu.so"))
    reason = _arm64_runs_here()
    if reason:
        pytest.skip(f"the arm64 image is built and checked, not started: {reason}")
    env = {"PATH": found["config"]["config"]["Env"][0].split("=", 1)[1]}
    proc = subprocess.run(
        debian_rootfs.chroot_argv(rootfs, ["sh", "-c", START], {}, env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:3] == ["aarch64", "imports ok", "entry modules ok"], proc.stdout
    assert lines[3].startswith("usage: flexgpu-kubelet-plugin"), lines
    assert lines[4].startswith("usage: flexgpu-controller"), lines
    assert lines[5].startswith("NVIDIA Container Toolkit CLI version"), lines
    assert lines[6].startswith("NVIDIA CDI Hook version"), lines


def _fresh_cache(tmp: Path, shared: Path) -> Path:
    """An empty image cache sharing only downloads and the Go programs (as the amd64
    reproducibility test shares them): both architectures' .deb files, the arm64 wheels."""
    tmp.mkdir()
    for entry in shared.glob("hooks-*"):
        (tmp / entry.name).symlink_to(entry)
    (tmp / "images").mkdir()
    for name in ("debs", "debs-arm64", "wheels-arm64"):
        (tmp / "images" / name).symlink_to(shared / "images" / name, target_is_directory=True)
    return tmp


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRegistry]:
    reg = LocalRegistry(tmp_path_factory.mktemp("registry"))
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


def test_the_index_is_reproducible_holds_the_tested_amd64_image_and_is_pushed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: LocalRegistry
) -> None:
    index = build.flexgpu_index()
    amd64 = manifest_digest(str(build.flexgpu_image("amd64").archive))
    arm64 = manifest_digest(str(build.flexgpu_image("arm64").archive))
    digest = manifest_digest(str(index.archive))
    with tarfile.open(index.archive) as tar:
        entry = json.loads(tar.extractfile("index.json").read())["manifests"][0]  # type: ignore[union-attr]
        assert entry["mediaType"] == oci.INDEX_MEDIA_TYPE
        blob = tar.extractfile(f"blobs/sha256/{digest.split(':')[1]}")
        listed = json.loads(blob.read())["manifests"]  # type: ignore[union-attr]
    # The index's amd64 image is the one every amd64 test runs, byte for byte.
    assert [(m["platform"]["architecture"], m["digest"]) for m in listed] == [
        ("amd64", amd64),
        ("arm64", arm64),
    ]
    # What the release pushes: the registry serves the index under the archive's digest.
    pushed = push(str(index.archive), f"{registry.address}/flexgpu:release")
    assert pushed == f"{registry.address}/flexgpu@{digest}"
    req = urllib.request.Request(
        f"http://{registry.address}/v2/flexgpu/manifests/release",
        headers={"Accept": oci.INDEX_MEDIA_TYPE},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        served = json.loads(resp.read())["manifests"]
    assert [m["digest"] for m in served] == [amd64, arm64]
    shared = cache_root().parent
    monkeypatch.setenv("FLEXGPU_CACHE", str(_fresh_cache(tmp_path / "fresh", shared)))
    again = build.flexgpu_index()
    assert again.archive.is_relative_to(tmp_path / "fresh")
    # Layer by layer first: a difference names the architecture and layer that changed.
    assert _layer_digests(again.archive) == _layer_digests(index.archive)
    assert manifest_digest(str(again.archive)) == digest


def _layer_digests(index_archive: Path) -> dict[str, list[str]]:
    """Architecture -> the digests of its image's layers, read from an index archive."""
    with tarfile.open(index_archive) as tar:

        def blob(digest: str) -> Any:
            member = tar.extractfile(f"blobs/sha256/{digest.split(':')[1]}")
            assert member is not None
            return json.loads(member.read())

        top = json.loads(tar.extractfile("index.json").read())["manifests"][0]  # type: ignore[union-attr]
        return {
            entry["platform"]["architecture"]: [
                layer["digest"] for layer in blob(entry["digest"])["layers"]
            ]
            for entry in blob(top["digest"])["manifests"]
        }


def test_a_dependency_without_an_arm64_wheel_stops_the_build_named(tmp_path: Path) -> None:
    """Nothing is compiled for arm64: pycrypto 2.6.1 is published as a source archive only,
    so the build stops naming it (and not idna, which has a wheel)."""
    with pytest.raises(wheels.WheelError) as err:
        wheels.download("arm64", ["idna==3.21", "pycrypto==2.6.1"], tmp_path)
    assert "no linux/arm64 wheel for Python 3.11" in str(err.value)
    assert "for pycrypto==2.6.1 (platforms manylinux2014_aarch64" in str(err.value)
    assert "idna" not in str(err.value).split("pip said")[0]
