"""Builds container images as OCI archives in the tool cache, without a container engine:

- the flexgpu image, the one the release publishes and every test runs: Debian 12's Python
  3.11 runtime (its .deb packages), flexgpu's dependencies as installed in this environment,
  the Go programs it ships (hooks/: NVIDIA's CDI tools and flexgpu's hooks) and the project's
  own packages from the source tree;
- for the real test node: the sandbox (pause) image, a small static program of our own, and
  the GPU workload image, busybox and a script that reports what the container received;
- a Debian stand-in for ``ubuntu:22.04``, the image NVIDIA's quickstart manifests name, so the
  node runs those manifests unchanged without reaching Docker Hub (see ``ubuntu_standin_image``).

Reproducible: layers are tars with sorted entries, owned by root and dated at the epoch, and
the image config has no build time, so the same inputs give the same digest (docs/releasing.md
lists the inputs; ``--inputs`` prints them). Each layer is cached under a key of its inputs,
so a warm build only re-tars what changed (the flexgpu packages). Layers and archives follow
the build cache's rules (tools/buildcache.py): written to a temp file and renamed, a hit
counts as a use, and eviction keeps what was used in the keep period.

    python -m tools.images.build [pause|workload|ubuntu|flexgpu ...] [--inputs]

prints ``role, name, archive`` per image (all of them by default).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tools import buildcache
from tools.images import debs, oci, python_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REGISTRY = "local.flexgpu.dev"
PAUSE_IMAGE = f"{REGISTRY}/pause:1"
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
BUSYBOX_DEB = "busybox-static"
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
SITE_PACKAGES = "usr/local/lib/python3.11/dist-packages"
IMAGE_PYTHON = (3, 11)


class ImageBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuiltImage:
    name: str
    archive: Path


def cache_root() -> Path:
    return buildcache.cache_root() / "images"


def _hash(parts: Iterable[bytes]) -> str:
    """A short digest of ``parts`` and of this file (its functions lay the layers out)."""
    h = hashlib.sha256(Path(__file__).read_bytes())
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def _tree_bytes(root: Path) -> Iterable[bytes]:
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
            continue
        yield str(path.relative_to(root)).encode()
        yield path.read_bytes()


def _cached_layer(key: str, populate: Callable[[Path], None]) -> oci.Layer:
    """The layer tar for ``key``, made by ``populate(rootfs)`` on a miss."""
    layers = cache_root() / "layers"
    layers.mkdir(parents=True, exist_ok=True)
    tar = layers / f"{key}.tar"
    digest_file = layers / f"{key}.digest"
    if tar.exists() and digest_file.exists():
        buildcache.touch(tar)
        return oci.Layer(tar, digest_file.read_text().strip(), tar.stat().st_size)
    with tempfile.TemporaryDirectory(prefix="flexgpu-layer-", dir=layers) as tmp:
        rootfs = Path(tmp) / "rootfs"
        rootfs.mkdir()
        populate(rootfs)
        layer = oci.write_layer(rootfs, tar)
    digest_file.write_text(layer.digest + "\n")
    # Every edit of the sources (or of this file) makes new layers.
    _evict(layers, f"{key.rsplit('-', 1)[0]}-*.tar", keep=tar)
    return layer


def _busybox_rootfs(rootfs: Path) -> None:
    """Static busybox with a link per applet, plus the files a shell expects."""
    debs.unpack(debs.fetch([BUSYBOX_DEB], cache_root() / "debs"), rootfs / ".deb")
    (rootfs / "bin").mkdir(exist_ok=True)
    shutil.move(str(rootfs / ".deb" / "bin" / "busybox"), rootfs / "bin" / "busybox")
    shutil.rmtree(rootfs / ".deb")
    applets = subprocess.run(
        [str(rootfs / "bin" / "busybox"), "--list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for applet in applets:
        link = rootfs / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    _base_files(rootfs)


def _base_files(rootfs: Path) -> None:
    etc = rootfs / "etc"
    etc.mkdir(exist_ok=True)
    # flexgpu (65532) is the user the chart runs the controller as.
    (etc / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\nflexgpu:x:65532:65532::/:/bin/false\n"
        "nobody:x:65534:65534::/:/bin/false\n"
    )
    (etc / "group").write_text("root:x:0:\nflexgpu:x:65532:\nnogroup:x:65534:\n")
    for d in ("tmp", "root", "proc", "sys", "dev", "run"):
        (rootfs / d).mkdir(exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)


def _archive(name: str, file_name: str, layers: list[oci.Layer], config: oci.ImageConfig) -> Path:
    parts = [name.encode(), repr(config).encode()]
    key = _hash(parts + [layer.digest.encode() for layer in layers])
    dest = cache_root() / f"{file_name}-{key}.tar"
    if dest.exists():
        buildcache.touch(dest)
    else:
        oci.write_archive(dest, name, layers, config)
        _evict(cache_root(), f"{file_name}-*.tar", keep=dest)
    return dest


def _evict(folder: Path, pattern: str, keep: Path) -> None:
    """The build cache's eviction over the files matching ``pattern`` (every source edit makes
    a new flexgpu layer and archive), with a layer's digest beside it."""
    for old in buildcache.evict(folder, pattern, keep=keep):
        old.with_suffix(".digest").unlink(missing_ok=True)


def pause_image() -> BuiltImage:
    source = HERE / "pause.c"

    def populate(rootfs: Path) -> None:
        if shutil.which("gcc") is None:
            raise ImageBuildError("gcc is needed to build the node's pause program")
        subprocess.run(
            ["gcc", "-static", "-Os", "-s", "-o", str(rootfs / "pause"), str(source)],
            check=True,
        )

    layer = _cached_layer("pause-" + _hash([source.read_bytes()]), populate)
    config = oci.ImageConfig(entrypoint=("/pause",), user="65535:65535")
    return BuiltImage(PAUSE_IMAGE, _archive(PAUSE_IMAGE, "pause", [layer], config))


def workload_image() -> BuiltImage:
    script = HERE / "report.sh"
    base = _cached_layer("busybox-" + _hash([BUSYBOX_DEB.encode()]), _busybox_rootfs)

    def populate(rootfs: Path) -> None:
        (rootfs / "usr" / "local" / "bin").mkdir(parents=True)
        target = rootfs / "usr" / "local" / "bin" / "gpu-report"
        shutil.copy2(script, target)
        target.chmod(0o755)

    top = _cached_layer("report-" + _hash([script.read_bytes()]), populate)
    tag = _hash([base.digest.encode(), top.digest.encode()])
    name = f"{REGISTRY}/gpu-workload:{tag}"
    config = oci.ImageConfig(
        entrypoint=("/usr/local/bin/gpu-report",),
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
    )
    return BuiltImage(name, _archive(name, "gpu-workload", [base, top], config))


def _ubuntu_standin_rootfs(rootfs: Path) -> None:
    debs.unpack(debs.fetch(UBUNTU_STANDIN_DEBS, cache_root() / "debs"), rootfs)
    shutil.rmtree(rootfs / "usr" / "share" / "doc", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "man", ignore_errors=True)
    shutil.rmtree(rootfs / "usr" / "share" / "info", ignore_errors=True)
    _base_files(rootfs)
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
    layer = _cached_layer(
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
    return BuiltImage(UBUNTU_STANDIN, _archive(UBUNTU_STANDIN, "ubuntu-standin", [layer], config))


def _python_base(rootfs: Path) -> None:
    _busybox_rootfs(rootfs)
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
    return _cached_layer("toolkit-" + _hash([folder.name.encode()]), populate)


def flexgpu_image() -> BuiltImage:
    base = _cached_layer("python-" + _hash([d.encode() for d in PYTHON_DEBS]), _python_base)
    deps = _cached_layer("pydeps-" + _hash([python_env.dependency_key().encode()]), _dependencies)
    toolkit = _toolkit_layer()
    sources = [REPO / "pyproject.toml"]
    app_key = _hash(
        [p.read_bytes() for p in sources]
        + [b for pkg in python_env.OWN_PACKAGES for b in _tree_bytes(REPO / pkg)]
    )
    app = _cached_layer("flexgpu-" + app_key, _project)
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
    return BuiltImage(name, _archive(name, "flexgpu", layers, config))


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
        + [b for pkg in python_env.OWN_PACKAGES for b in _tree_bytes(REPO / pkg)]
    )
    found.append(f"source {tree} (version {_version()})")
    return found


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
