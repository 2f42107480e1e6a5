"""The flexgpu image, the one the release publishes and every test runs: Debian 12's Python
3.11 runtime (its .deb packages), flexgpu's dependencies as installed in this environment, the
Go programs it ships (hooks/: NVIDIA's CDI tools and flexgpu's hooks) and the project's own
packages from the source tree, as an OCI archive in the tool cache, without a container
engine (layout and cache: release/layers.py). docs/releasing.md lists what decides its digest;
``--inputs`` prints it.

    python -m release.image [--inputs]

prints ``flexgpu, name, archive``.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path

from release import debs, oci, python_env
from release.layers import (
    BUSYBOX_DEB,
    REGISTRY,
    REPO,
    BuiltImage,
    ImageBuildError,
    archive,
    busybox_rootfs,
    cache_root,
    cached_layer,
    layer_key,
    tree_bytes,
)
from tools import buildcache

PYTHON_DEBS = (
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libc6",
    "libssl3",
    "libexpat1",
    "zlib1g",
    "libbz2-1.0",
    "liblzma5",
    "libffi8",
    "libcrypt1",
    "libuuid1",
    "libgcc-s1",
    "libstdc++6",
    "media-types",
)
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
IMAGE_PYTHON = (3, 11)


def _python_base(rootfs: Path) -> None:
    busybox_rootfs(rootfs)
    debs.unpack(debs.fetch(PYTHON_DEBS, cache_root() / "debs"), rootfs)
    # Debian's /bin is a link to usr/bin in a merged /usr; here busybox owns /bin.
    for name in ("python3", "python"):
        link = rootfs / "usr" / "bin" / name
        if not link.exists():
            link.symlink_to("python3.11")
    shutil.rmtree(rootfs / "usr" / "share" / "doc", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "man", ignore_errors=True)


def _dependencies(rootfs: Path) -> None:
    if sys.version_info[:2] != IMAGE_PYTHON:
        # Compiled wheels (grpcio, pydantic-core, cryptography) are built per Python version.
        raise ImageBuildError(
            f"the flexgpu image runs Python {'.'.join(map(str, IMAGE_PYTHON))} (Debian's), "
            f"but this environment is Python {sys.version_info[0]}.{sys.version_info[1]}: "
            "its compiled dependencies would not load there; make the venv with python3.11"
        )
    site = rootfs / SITE_PACKAGES
    site.mkdir(parents=True)
    python_env.copy_dependencies(site)


def _project(rootfs: Path) -> None:
    site = rootfs / SITE_PACKAGES
    site.mkdir(parents=True)
    python_env.copy_project(REPO, site)
    bin_dir = rootfs / "usr" / "local" / "bin"
    bin_dir.mkdir(parents=True)
    for script, target in python_env.console_scripts().items():
        module, _, func = target.partition(":")
        path = bin_dir / script
        path.write_text(
            f"#!/usr/bin/python3.11\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
        )
        path.chmod(0o755)


TOOLKIT_SCRIPT = buildcache.SCRIPTS["hooks"]
TOOLKIT_PROGRAMS = ("nvidia-ctk", "nvidia-cdi-hook", "flexgpu-cdi-common", "flexgpu-cdi-hooks")


def _toolkit_dir() -> Path:
    """The Go programs the image ships (nvidia-ctk, the static nvidia-cdi-hook,
    flexgpu-cdi-common, flexgpu-cdi-hooks), built by hooks/ from its module pins."""
    try:
        return buildcache.path("hooks", timeout=1800)
    except buildcache.BuildError as e:
        raise ImageBuildError(str(e)) from e


def _toolkit_layer() -> oci.Layer | None:
    if not TOOLKIT_SCRIPT.exists():
        return None
    folder = _toolkit_dir()
    programs = [folder / name for name in TOOLKIT_PROGRAMS if (folder / name).is_file()]

    def populate(rootfs: Path) -> None:
        bin_dir = rootfs / "usr" / "local" / "bin"
        bin_dir.mkdir(parents=True)
        for program in programs:
            shutil.copy2(program, bin_dir / program.name)

    # The tool cache names its folder after the tools' sources: that is the layer's key.
    return cached_layer("toolkit-" + _hash([folder.name.encode()]), populate)


def flexgpu_image() -> BuiltImage:
    base = cached_layer("python-" + _hash([d.encode() for d in PYTHON_DEBS]), _python_base)
    deps = cached_layer("pydeps-" + _hash([python_env.dependency_key().encode()]), _dependencies)
    toolkit = _toolkit_layer()
    sources = [REPO / "pyproject.toml"]
    app_key = _hash(
        [p.read_bytes() for p in sources]
        + [b for pkg in python_env.OWN_PACKAGES for b in tree_bytes(REPO / pkg)]
    )
    app = cached_layer("flexgpu-" + app_key, _project)
    layers = [base, deps, *([toolkit] if toolkit else []), app]
    tag = _hash([layer.digest.encode() for layer in layers])
    name = f"{REGISTRY}/flexgpu:{tag}"
    config = oci.ImageConfig(
        cmd=("flexgpu-controller",),
        env={
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        },
        labels={
            "org.opencontainers.image.title": "flexgpu",
            "org.opencontainers.image.description": "Kubernetes DRA driver for GPU flex nodes",
            "org.opencontainers.image.licenses": "Apache-2.0",
            "org.opencontainers.image.version": _version(),
        },
    )
    return BuiltImage(name, archive(name, "flexgpu", layers, config))


def _version() -> str:
    match = re.search(r'VERSION: Final = "([^"]+)"', (REPO / "driver" / "version.py").read_text())
    if match is None:
        raise ImageBuildError("driver/version.py names no VERSION")
    return match.group(1)


def inputs() -> list[str]:
    """What decides the flexgpu image's digest, one line each: the Debian packages (name
    and version of each .deb), the Python distributions, the toolkit build and the source
    tree's hash."""
    found = [
        f"deb {deb.name}" for deb in debs.fetch([BUSYBOX_DEB, *PYTHON_DEBS], cache_root() / "debs")
    ]
    found += [f"python {line}" for line in python_env.dependency_key().splitlines()]
    if TOOLKIT_SCRIPT.exists():
        found.append(f"toolkit {_toolkit_dir().name}")
    tree = _hash(
        [(REPO / "pyproject.toml").read_bytes()]
        + [b for pkg in python_env.OWN_PACKAGES for b in tree_bytes(REPO / pkg)]
    )
    found.append(f"source {tree} (version {_version()})")
    return found


def _hash(parts: Iterable[bytes]) -> str:
    return layer_key(Path(__file__), parts)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--inputs"]
    if unknown:
        print(f"error: unknown argument {unknown[0]!r}; expected --inputs or none", file=sys.stderr)
        return 2
    try:
        if args:
            print("\n".join(inputs()))
            return 0
        image = flexgpu_image()
    except (ImageBuildError, debs.DebError) as err:
        print(f"error: building the flexgpu image failed: {err}", file=sys.stderr)
        return 1
    print(f"flexgpu\t{image.name}\t{image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
