"""The stand-in for ``ubuntu:22.04`` that the real node runs NVIDIA's quickstart manifests in
(tools/images): named as containerd resolves ``ubuntu:22.04``, built reproducibly from Debian
packages, saying what it is, and able to run the manifests' command and the report script."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from release import oci
from release.push import manifest_digest
from tools.images import build, debian_rootfs

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="chroot and mount namespaces need root"),
]

# The command every ubuntu:22.04 container of NVIDIA's quickstart runs, with a short sleep,
# and a script run through its #!/bin/sh line.
MANIFEST_COMMAND = (
    "nvidia-smi -L; trap 'exit 0' TERM; sleep 0.1 & wait; "
    "printf '#!/bin/sh\\necho done\\n' > /tmp/s; chmod +x /tmp/s; /tmp/s"
)


def _image(archive: Path, rootfs: Path) -> dict[str, Any]:
    """Unpacks the image's layers into ``rootfs``; returns its index entry and config."""
    rootfs.mkdir()
    with tarfile.open(archive) as tar:

        def read(name: str) -> Any:
            member = tar.extractfile(name)
            assert member is not None
            return member

        def blob(digest: str) -> Any:
            return read(f"blobs/sha256/{digest.split(':')[1]}")

        entry = json.loads(read("index.json").read())["manifests"][0]
        manifest = json.loads(blob(entry["digest"]).read())
        config = json.loads(blob(manifest["config"]["digest"]).read())
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=blob(layer["digest"])) as inner:
                inner.extractall(rootfs, filter="tar")
    return {"entry": entry, "config": config}


def test_two_builds_from_empty_caches_give_the_same_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build.ubuntu_standin_image()  # fills the shared .deb cache
    debs = build.cache_root() / "debs"
    digests = []
    for run in ("a", "b"):
        (tmp_path / run / "images").mkdir(parents=True)
        (tmp_path / run / "images" / "debs").symlink_to(debs, target_is_directory=True)
        monkeypatch.setenv("FLEXGPU_CACHE", str(tmp_path / run))
        image = build.ubuntu_standin_image()
        assert image.archive.is_relative_to(tmp_path / run)
        digests.append(manifest_digest(str(image.archive)))
    assert digests[0] == digests[1], digests


def test_the_standin_answers_to_ubuntu_and_runs_the_manifests_command(tmp_path: Path) -> None:
    image = build.ubuntu_standin_image()
    assert image.name == "docker.io/library/ubuntu:22.04"
    rootfs = tmp_path / "rootfs"
    found = _image(image.archive, rootfs)
    assert found["entry"]["annotations"][oci.CONTAINERD_NAME] == image.name
    config = found["config"]["config"]
    assert config["Cmd"] == ["/bin/bash"]
    assert "stand-in for ubuntu:22.04" in config["Labels"]["org.opencontainers.image.description"]
    # It says what it is to anything that looks inside.
    assert "ID=debian" in (rootfs / "etc" / "os-release").read_text()
    assert not (rootfs / "usr" / "bin" / "nvidia-smi").exists(), "the driver brings nvidia-smi"
    # Programs written as shell scripts (the simulated driver's nvidia-smi) need /bin/sh.
    assert (rootfs / "bin" / "sh").readlink() == Path("dash")

    env = {"PATH": config["Env"][0].split("=", 1)[1]}
    manifest = subprocess.run(
        debian_rootfs.chroot_argv(rootfs, ["bash", "-c", MANIFEST_COMMAND], {}, env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Without a driver's CDI edits there is no nvidia-smi; the rest of the command runs.
    assert manifest.returncode == 0, manifest.stderr
    assert "nvidia-smi: command not found" in manifest.stderr
    assert manifest.stdout.strip() == "done"

    script = "REPORT_ONCE=1\n" + (build.HERE / "report.sh").read_text()
    reported = subprocess.run(
        debian_rootfs.chroot_argv(rootfs, ["bash", "-c", script], {Path("/proc"): "/proc"}, env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert reported.returncode == 0, reported.stderr
    assert not reported.stderr, reported.stderr
    lines = reported.stdout.splitlines()
    assert lines[0] == "fgr 1 begin" and lines[-1] == "fgr 1 end", lines
    assert f"fgr 1 env PATH={env['PATH']}" in lines
