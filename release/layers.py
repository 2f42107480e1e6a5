"""How the release image is laid out and cached, shared by every image recipe (the flexgpu
image here, the test world's images in tools/images): reproducible layers (tars with sorted
entries, owned by root and dated at the epoch, an image config without a build time, so the
same inputs give the same digest), each cached under a key of its inputs and of the recipe
that lays it out. Layers and archives follow the build cache's rules (tools/buildcache.py):
written to a temp file and renamed, a hit counts as a use, and eviction keeps what was used in
the keep period."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from release import debs, oci
from tools import buildcache

REPO = Path(__file__).resolve().parents[1]
REGISTRY = "local.flexgpu.dev"
BUSYBOX_DEB = "busybox-static"
IMAGE_KEEP_DAYS = 1.0


class ImageBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BuiltImage:
    name: str
    archive: Path


def cache_root() -> Path:
    return buildcache.cache_root() / "images"


def layer_key(recipe: Path, parts: Iterable[bytes]) -> str:
    """A short digest of ``parts``, of this file and of ``recipe`` (their functions lay the
    layers out)."""
    h = hashlib.sha256(Path(__file__).read_bytes() + recipe.read_bytes())
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:12]


def tree_bytes(root: Path) -> Iterable[bytes]:
    for path in sorted(root.rglob("*")):
        if "__pycache__" in path.parts or path.suffix == ".pyc" or not path.is_file():
            continue
        yield str(path.relative_to(root)).encode()
        yield path.read_bytes()


def cached_layer(key: str, populate: Callable[[Path], None]) -> oci.Layer:
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


def busybox_rootfs(rootfs: Path, arch: str | None = None) -> None:
    """Static busybox (of ``arch``, default this machine's) with a link per applet, plus the
    files a shell expects."""
    cache = cache_root() / "debs"
    (deb,) = debs.fetch([BUSYBOX_DEB], cache, arch)
    debs.unpack([deb], rootfs / ".deb")
    (rootfs / "bin").mkdir(exist_ok=True)
    shutil.move(str(rootfs / ".deb" / "bin" / "busybox"), rootfs / "bin" / "busybox")
    shutil.rmtree(rootfs / ".deb")
    for applet in _applets(deb, cache):
        link = rootfs / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    base_files(rootfs)


def _applets(deb: Path, cache: Path) -> list[str]:
    """The applets of the busybox in ``deb``, as this machine's busybox of the same Debian
    source version lists them (one configuration builds every architecture's, and another
    architecture's binary does not run here)."""
    (native,) = debs.fetch([BUSYBOX_DEB], cache)
    if _source_version(native) != _source_version(deb):
        raise ImageBuildError(
            f"{BUSYBOX_DEB} {debs.version(deb)} ({deb.name}) and this machine's "
            f"{debs.version(native)} come from different sources: its applet list cannot "
            "be read here; refresh the package lists so both are the current point release"
        )
    with tempfile.TemporaryDirectory(prefix="flexgpu-busybox-") as tmp:
        debs.unpack([native], Path(tmp))
        return subprocess.run(
            [str(Path(tmp) / "bin" / "busybox"), "--list"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()


def _source_version(deb: Path) -> str:
    # A binNMU (+bN) rebuilds the same source for one architecture; the applets stay.
    return re.sub(r"\+b\d+$", "", debs.version(deb))


def base_files(rootfs: Path) -> None:
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


def archive(
    name: str,
    file_name: str,
    layers: list[oci.Layer],
    config: oci.ImageConfig,
    architecture: str = "amd64",
) -> Path:
    parts = [name.encode(), repr(config).encode()]
    if architecture != "amd64":
        parts.append(architecture.encode())
    key = layer_key(Path(__file__), parts + [layer.digest.encode() for layer in layers])
    dest = cache_root() / f"{file_name}-{key}.tar"
    if dest.exists():
        buildcache.touch(dest)
    else:
        oci.write_archive(dest, name, layers, config, architecture)
        _evict(cache_root(), f"{file_name}-*.tar", keep=dest)
    return dest


def index_archive(name: str, file_name: str, images: Sequence[oci.PlatformImage]) -> Path:
    """An archive of the image index ``name`` over ``images`` (one per platform)."""
    parts = [name.encode()]
    for image in images:
        parts += [image.architecture.encode(), repr(image.config).encode()]
        parts += [layer.digest.encode() for layer in image.layers]
    dest = cache_root() / f"{file_name}-{layer_key(Path(__file__), parts)}.tar"
    if dest.exists():
        buildcache.touch(dest)
    else:
        oci.write_index_archive(dest, name, images)
        _evict(cache_root(), f"{file_name}-*.tar", keep=dest)
    return dest


def _evict(folder: Path, pattern: str, keep: Path) -> None:
    """The build cache's eviction over the files matching ``pattern``, with a layer's digest
    beside it. Every source edit makes a new flexgpu layer and archive (about 200 MB), and one
    is made again from the cached layers in seconds: those unused for a day go."""
    for old in buildcache.evict(folder, pattern, keep=keep, keep_days=IMAGE_KEEP_DAYS):
        old.with_suffix(".digest").unlink(missing_ok=True)
