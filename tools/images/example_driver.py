"""The reference DRA driver's kubelet-plugin image, for the real node only: the statically
linked ``dra-example-kubeletplugin`` of sigs.k8s.io/dra-example-driver (the version
tools/example-driver pins, built there from the module) on PATH, as its chart runs it
(``command: ["dra-example-kubeletplugin"]``). The test world reaches no public registry, so
this stands in for the project's released image; its label says so. Built on demand (the
benchmark and the node test that deploy the chart), not with the node's other images.

    python -m tools.images.example_driver

prints ``name, archive``.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from release import layers, oci
from tools import buildcache

GO_MOD = layers.REPO / "tools" / "example-driver" / "go.mod"
MODULE = "sigs.k8s.io/dra-example-driver"
PROGRAM = "dra-example-kubeletplugin"
REPOSITORY = f"{layers.REGISTRY}/dra-example-driver"


def _hash(parts: list[bytes]) -> str:
    return layers.layer_key(Path(__file__), parts)


def version() -> str:
    """The module version tools/example-driver/go.mod pins (also the chart's appVersion)."""
    match = re.search(rf"^\s*(?:require\s+)?{re.escape(MODULE)}\s+(v\S+)", GO_MOD.read_text(), re.M)
    if match is None:
        raise layers.ImageBuildError(f"{GO_MOD} pins no version of {MODULE}")
    return match.group(1)


def binary() -> Path:
    """Builds the plugin (or finds it in the tool cache); its path."""
    try:
        return buildcache.path("example-driver", timeout=1800) / PROGRAM
    except buildcache.BuildError as e:
        raise layers.ImageBuildError(str(e)) from e


def example_driver_image() -> layers.BuiltImage:
    program = binary()
    pinned = version()

    def populate(rootfs: Path) -> None:
        bin_dir = rootfs / "usr" / "local" / "bin"
        bin_dir.mkdir(parents=True)
        shutil.copy2(program, bin_dir / PROGRAM)
        # /etc/passwd, /tmp and the mount points a container expects; the program is static.
        layers.base_files(rootfs)

    # The build cache names its folder after the module pins: that and the version key it.
    layer = layers.cached_layer(
        "example-driver-" + _hash([pinned.encode(), program.parent.name.encode()]),
        populate,
    )
    name = f"{REPOSITORY}:{pinned}-{_hash([layer.digest.encode()])}"
    config = oci.ImageConfig(
        entrypoint=(PROGRAM,),
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        labels={
            "org.opencontainers.image.title": "dra-example-driver",
            "org.opencontainers.image.version": pinned,
            "org.opencontainers.image.description": (
                f"{MODULE} {pinned} kubelet plugin ({PROGRAM}, statically linked), built from "
                "the upstream module by flexgpu's tools/example-driver for a test world "
                "without a public registry"
            ),
        },
    )
    return layers.BuiltImage(name, layers.archive(name, "dra-example-driver", [layer], config))


def main() -> int:
    try:
        image = example_driver_image()
    except layers.ImageBuildError as err:
        print(f"error: building the reference driver's image failed: {err}", file=sys.stderr)
        return 1
    print(f"{image.name}\t{image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
