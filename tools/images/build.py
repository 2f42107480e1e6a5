"""Builds the test world's container images as OCI archives in the tool cache, without a
container engine, with the release image's layout and cache (release/layers.py):

- for the real test node: the sandbox (pause) image, a small static program of our own, and
  the GPU workload image, busybox and a script that reports what the container received;
- a Debian stand-in for ``ubuntu:22.04``, the image NVIDIA's quickstart manifests name, so the
  node runs those manifests unchanged without reaching Docker Hub (see ``ubuntu_standin_image``);
- and the flexgpu image itself (release/image.py), the one the release publishes.

    python -m tools.images.build [pause|workload|ubuntu|flexgpu ...] [--inputs]

prints ``role, name, archive`` per image (all of them by default; ``--inputs``: what decides
the flexgpu image's digest).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from release import debs, oci
from release.image import flexgpu_image, inputs
from release.layers import (
    BUSYBOX_DEB,
    REGISTRY,
    BuiltImage,
    ImageBuildError,
    archive,
    base_files,
    busybox_rootfs,
    cache_root,
    cached_layer,
    layer_key,
)

HERE = Path(__file__).resolve().parent
PAUSE_IMAGE = f"{REGISTRY}/pause:1"
# The image name NVIDIA's quickstart manifests use (`ubuntu:22.04`), as containerd normalises
# it: the stand-in is imported under that name.
UBUNTU_STANDIN = "docker.io/library/ubuntu:22.04"
# What the manifests' commands (`bash -c "nvidia-smi -L; trap ...; sleep 9999 & wait"`) and the
# report script need: bash, coreutils (sleep, env, sort, head, stat), sed, grep, hostname,
# and the libraries they link (listed, not resolved, so the set does not move with apt); dash
# for /bin/sh, which Ubuntu's image has and the simulated driver's programs are scripts for.
UBUNTU_STANDIN_DEBS = (
    "base-files",
    "bash",
    "dash",
    "coreutils",
    "sed",
    "grep",
    "hostname",
    "libc6",
    "libgcc-s1",
    "libtinfo6",
    "libacl1",
    "libattr1",
    "libgmp10",
    "libselinux1",
    "libpcre2-8-0",
)


def _hash(parts: Iterable[bytes]) -> str:
    return layer_key(Path(__file__), parts)


def pause_image() -> BuiltImage:
    source = HERE / "pause.c"

    def populate(rootfs: Path) -> None:
        if shutil.which("gcc") is None:
            raise ImageBuildError("gcc is needed to build the node's pause program")
        subprocess.run(
            ["gcc", "-static", "-Os", "-s", "-o", str(rootfs / "pause"), str(source)],
            check=True,
        )

    layer = cached_layer("pause-" + _hash([source.read_bytes()]), populate)
    config = oci.ImageConfig(entrypoint=("/pause",), user="65535:65535")
    return BuiltImage(PAUSE_IMAGE, archive(PAUSE_IMAGE, "pause", [layer], config))


def workload_image() -> BuiltImage:
    script = HERE / "report.sh"
    base = cached_layer("busybox-" + _hash([BUSYBOX_DEB.encode()]), busybox_rootfs)

    def populate(rootfs: Path) -> None:
        (rootfs / "usr" / "local" / "bin").mkdir(parents=True)
        target = rootfs / "usr" / "local" / "bin" / "gpu-report"
        shutil.copy2(script, target)
        target.chmod(0o755)

    top = cached_layer("report-" + _hash([script.read_bytes()]), populate)
    tag = _hash([base.digest.encode(), top.digest.encode()])
    name = f"{REGISTRY}/gpu-workload:{tag}"
    config = oci.ImageConfig(
        entrypoint=("/usr/local/bin/gpu-report",),
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    return BuiltImage(name, archive(name, "gpu-workload", [base, top], config))


def _ubuntu_standin_rootfs(rootfs: Path) -> None:
    debs.unpack(debs.fetch(UBUNTU_STANDIN_DEBS, cache_root() / "debs"), rootfs)
    shutil.rmtree(rootfs / "usr" / "share" / "doc", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "man", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "info", ignore_errors=True)
    base_files(rootfs)
    (rootfs / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n"
    )
    (rootfs / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")


def ubuntu_standin_image() -> BuiltImage:
    """A Debian 12 image named ``docker.io/library/ubuntu:22.04``: bash, dash as /bin/sh,
    coreutils, sed, grep and hostname from Debian's packages, nothing of Ubuntu's. The test
    world reaches no public registry, and NVIDIA's quickstart manifests run ``bash -c`` in
    ``ubuntu:22.04``; under this name the node runs them byte for byte. What a DRA driver
    gives a container (device nodes, driver files and programs such as nvidia-smi,
    environment) comes from the CDI edits the runtime applies, whatever the image; the image
    supplies only the shell and its tools, the same one to both drivers' pods. Its label and
    /etc/os-release say what it is."""
    layer = cached_layer(
        "ubuntu-standin-" + _hash([d.encode() for d in UBUNTU_STANDIN_DEBS]),
        _ubuntu_standin_rootfs,
    )
    # Ubuntu's image config: a PATH and bash as the command.
    config = oci.ImageConfig(
        cmd=("/bin/bash",),
        env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
        labels={
            "org.opencontainers.image.description": (
                "Debian 12 stand-in for ubuntu:22.04 (bash, dash, coreutils, sed, grep, "
                "hostname), built by flexgpu's tools/images for a test world without a "
                "public registry"
            ),
        },
    )
    return BuiltImage(UBUNTU_STANDIN, archive(UBUNTU_STANDIN, "ubuntu-standin", [layer], config))


BUILDERS: dict[str, Callable[[], BuiltImage]] = {
    "pause": pause_image,
    "workload": workload_image,
    "ubuntu": ubuntu_standin_image,
    "flexgpu": flexgpu_image,
}


def build_all() -> dict[str, BuiltImage]:
    return {role: build() for role, build in BUILDERS.items()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    roles = [a for a in args if not a.startswith("--")] or list(BUILDERS)
    unknown = [r for r in roles if r not in BUILDERS]
    if unknown:
        print(
            f"error: unknown image {unknown[0]!r}; expected one of {', '.join(BUILDERS)}",
            file=sys.stderr,
        )
        return 2
    try:
        if "--inputs" in args:
            print("\n".join(inputs()))
            return 0
        images = {role: BUILDERS[role]() for role in roles}
    except (ImageBuildError, debs.DebError, subprocess.CalledProcessError) as err:
        print(f"error: building the images failed: {err}", file=sys.stderr)
        return 1
    for role, image in images.items():
        print(f"{role}\t{image.name}\t{image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
