"""The flexgpu image, the one the release publishes and every test runs: Debian 12's Python
3.11 runtime (its .deb packages), flexgpu's dependencies as installed in this environment, the
Go programs it ships (hooks/: NVIDIA's CDI tools and flexgpu's hooks) and the project's own
packages from the source tree, as an OCI archive in the tool cache, without a container
engine (layout and cache: release/layers.py). docs/releasing.md lists what decides its digest;
``--inputs`` prints it.

    python -m release.image [--platforms linux/amd64,linux/arm64] [--inputs]

prints ``flexgpu, name, archive``. One platform (default: this machine's) gives an image; several
give an image index over one image per platform, each built the same way from that
architecture's Debian packages, wheels and cross-compiled Go programs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

from release import debs, oci, python_env, wheels
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
    index_archive,
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


ARCHITECTURES = ("amd64", "arm64")


def _python_base(rootfs: Path, arch: str) -> None:
    busybox_rootfs(rootfs, arch)
    debs.unpack(debs.fetch(PYTHON_DEBS, cache_root() / "debs", arch), rootfs)
    # Debian's /bin is a link to usr/bin in a merged /usr; here busybox owns /bin.
    for name in ("python3", "python"):
        link = rootfs / "usr" / "bin" / name
        if not link.exists():
            link.symlink_to("python3.11")
    shutil.rmtree(rootfs / "usr" / "share" / "doc", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "man", ignore_errors=True)


def _dependencies(rootfs: Path, arch: str) -> None:
    if sys.version_info[:2] != IMAGE_PYTHON:
        # Compiled wheels (grpcio, pydantic-core, cryptography) are built per Python version.
        raise ImageBuildError(
            f"the flexgpu image runs Python {'.'.join(map(str, IMAGE_PYTHON))} (Debian's), "
            f"but this environment is Python {sys.version_info[0]}.{sys.version_info[1]}: "
            "its compiled dependencies would not load there; make the venv with python3.11"
        )
    site = rootfs / SITE_PACKAGES
    if arch == debs.host_arch():
        site.mkdir(parents=True)
        python_env.copy_dependencies(site)
    else:
        # This environment's compiled modules are for this machine: the same versions'
        # wheels for the other architecture.
        wheels.install(arch, site, _wheel_cache(arch))


def _wheel_cache(arch: str) -> Path:
    return cache_root() / f"wheels-{arch}"


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


def _toolkit_dir(arch: str) -> Path:
    """The Go programs the image ships (nvidia-ctk, the static nvidia-cdi-hook,
    flexgpu-cdi-common, flexgpu-cdi-hooks), built by hooks/ from its module pins for
    ``arch``."""
    try:
        return buildcache.path("hooks", arch, timeout=1800)
    except buildcache.BuildError as e:
        raise ImageBuildError(str(e)) from e


def _toolkit_layer(arch: str) -> oci.Layer | None:
    if not TOOLKIT_SCRIPT.exists():
        return None
    folder = _toolkit_dir(arch)
    programs = [folder / name for name in TOOLKIT_PROGRAMS if (folder / name).is_file()]

    def populate(rootfs: Path) -> None:
        bin_dir = rootfs / "usr" / "local" / "bin"
        bin_dir.mkdir(parents=True)
        for program in programs:
            shutil.copy2(program, bin_dir / program.name)

    # The tool cache names its folder after the tools' sources and architecture: the key.
    return cached_layer("toolkit-" + _hash([folder.name.encode()]), populate)


def _check_arch(arch: str) -> str:
    if arch not in ARCHITECTURES:
        raise ImageBuildError(
            f"platform linux/{arch} is not built; allowed: "
            f"{', '.join('linux/' + a for a in ARCHITECTURES)}"
        )
    return arch


def platform_image(arch: str | None = None) -> oci.PlatformImage:
    """The layers and config of the image for linux/``arch`` (default: this machine's)."""
    arch = _check_arch(arch or debs.host_arch())
    tagged = arch.encode()
    # Keyed on the files the layers are made of, not only on their names: a cached layer
    # built from an older .deb or wheel (the tool cache outlives a point release or a wheel
    # added to the index) is not reused for newer ones.
    base = cached_layer(
        "python-" + _hash([tagged, *(line.encode() for line in _deb_inputs(arch))]),
        lambda rootfs: _python_base(rootfs, arch),
    )
    deps = cached_layer(
        "pydeps-"
        + _hash(
            [tagged, *_recipes(python_env, wheels)]
            + [line.encode() for line in _dependency_inputs(arch)]
        ),
        lambda rootfs: _dependencies(rootfs, arch),
    )
    toolkit = _toolkit_layer(arch)
    app = cached_layer("flexgpu-" + _source_key(), _project)
    layers = [base, deps, *([toolkit] if toolkit else []), app]
    return oci.PlatformImage(arch, layers, _config())


def _deb_inputs(arch: str) -> list[str]:
    """The .deb files the base layer of ``arch`` is made of (busybox's applet list comes
    from this machine's busybox of the same source version: that file too)."""
    cache = cache_root() / "debs"
    fetched = debs.fetch([BUSYBOX_DEB, *PYTHON_DEBS], cache, arch)
    if arch != debs.host_arch():
        fetched += debs.fetch([BUSYBOX_DEB], cache)
    return [f"deb {deb.name}" for deb in fetched]


def _dependency_inputs(arch: str) -> list[str]:
    """The distributions the dependency layer of ``arch`` holds and, for another
    architecture, the wheel files pip installs them from (downloaded first: what the index
    offers now decides which file pip picks)."""
    found = [f"python {line}" for line in python_env.dependency_key().splitlines()]
    if arch != debs.host_arch():
        wanted, cache = wheels.requirements(arch), _wheel_cache(arch)
        wheels.download(arch, wanted, cache)
        found += [f"wheel {name}" for name in wheels.wheel_files(arch, wanted, cache)]
    return found


def _recipes(*modules: ModuleType) -> list[bytes]:
    """The source of the modules that lay a layer out besides this one and release/layers.py
    (which every key holds): a change there must not reuse layers laid out before it."""
    return [Path(str(m.__file__)).read_bytes() for m in modules]


def _source_key() -> str:
    sources = [REPO / "pyproject.toml"]
    return _hash(
        _recipes(python_env)
        + [p.read_bytes() for p in sources]
        + [b for pkg in python_env.OWN_PACKAGES for b in tree_bytes(REPO / pkg)]
    )


def _config() -> oci.ImageConfig:
    return oci.ImageConfig(
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


def flexgpu_image(arch: str | None = None) -> BuiltImage:
    """The image for linux/``arch`` (default: this machine's, the one the tests run)."""
    image = platform_image(arch)
    tag = _hash([layer.digest.encode() for layer in image.layers])
    if image.architecture != "amd64":
        tag = f"{tag}-{image.architecture}"
    name = f"{REGISTRY}/flexgpu:{tag}"
    return BuiltImage(
        name, archive(name, "flexgpu", list(image.layers), image.config, image.architecture)
    )


def flexgpu_index(archs: Sequence[str] = ARCHITECTURES) -> BuiltImage:
    """The image index the release pushes: one image per architecture of ``archs``."""
    images = [platform_image(arch) for arch in archs]
    parts = [f"{i.architecture}:{layer.digest}".encode() for i in images for layer in i.layers]
    name = f"{REGISTRY}/flexgpu:{_hash(parts)}-index"
    return BuiltImage(name, index_archive(name, "flexgpu-index", images))


def _version() -> str:
    match = re.search(r'VERSION: Final = "([^"]+)"', (REPO / "driver" / "version.py").read_text())
    if match is None:
        raise ImageBuildError("driver/version.py names no VERSION")
    return match.group(1)


def inputs(archs: Sequence[str] | None = None) -> list[str]:
    """What decides the flexgpu image's digest (of each architecture of ``archs``, default
    this machine's), one line each: the Debian packages (name, version and architecture of
    each .deb), the Python distributions (and another architecture's wheel files), the
    toolkit build of each architecture and the source tree's hash."""
    archs = [_check_arch(a) for a in archs or [debs.host_arch()]]
    found: list[str] = []
    for arch in archs:
        found += [line for line in _deb_inputs(arch) if line not in found]
    for arch in archs:
        found += [line for line in _dependency_inputs(arch) if line not in found]
    if TOOLKIT_SCRIPT.exists():
        found += [f"toolkit linux/{arch} {_toolkit_dir(arch).name}" for arch in archs]
    found.append(f"source {_source_key()} (version {_version()})")
    return found


def _hash(parts: Iterable[bytes]) -> str:
    return layer_key(Path(__file__), parts)


def _platforms(text: str) -> list[str]:
    archs = []
    for item in text.split(","):
        os_name, _, arch = item.strip().partition("/")
        if os_name != "linux" or not arch:
            raise ImageBuildError(
                f"--platforms: {item.strip()!r} is not a platform; expected linux/<arch> "
                f"with <arch> one of {', '.join(ARCHITECTURES)}, comma-separated"
            )
        archs.append(_check_arch(arch))
    if len(set(archs)) != len(archs):
        raise ImageBuildError(f"--platforms: {text!r} names a platform twice")
    return archs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m release.image", description=__doc__)
    parser.add_argument(
        "--platforms",
        help="comma-separated linux/<arch> (amd64, arm64); several give an image index",
    )
    parser.add_argument("--inputs", action="store_true", help="print what decides the digest")
    args = parser.parse_args(argv)
    try:
        archs = _platforms(args.platforms) if args.platforms else [debs.host_arch()]
        if args.inputs:
            print("\n".join(inputs(archs)))
            return 0
        image = flexgpu_index(archs) if len(archs) > 1 else flexgpu_image(archs[0])
    except (ImageBuildError, debs.DebError, wheels.WheelError) as err:
        print(f"error: building the flexgpu image failed: {err}", file=sys.stderr)
        return 1
    print(f"flexgpu\t{image.name}\t{image.archive}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
