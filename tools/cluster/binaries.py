"""Finds the control-plane binaries: KUBEBUILDER_ASSETS, then v1.37+ binaries on PATH, then
the build cache (building on a miss with tools/k8s/build.sh), so a warm start costs nothing.

FLEXGPU_K8S=1.34 (``make test K8S=1.34``) picks another release tools/k8s can build; it skips
the PATH lookup and holds KUBEBUILDER_ASSETS to that release."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tools import buildcache

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = buildcache.SCRIPTS["k8s"]
DEFAULT_MODULE = REPO_ROOT / "tools" / "k8s" / "go.mod"
RELEASES_DIR = REPO_ROOT / "tools" / "k8s" / "releases"
RELEASE_ENV = "FLEXGPU_K8S"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
MIN_MINOR = 34


class BinariesError(RuntimeError):
    pass


def _has_all(folder: Path, names: tuple[str, ...]) -> bool:
    return all(os.access(folder / n, os.X_OK) for n in names)


def server_minor_version(apiserver: Path) -> int:
    out = subprocess.run(
        [str(apiserver), "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    match = re.search(r"v1\.(\d+)\.", out)
    if not match:
        raise BinariesError(f"{apiserver} --version printed {out.strip()!r}, not a v1.x version")
    return int(match.group(1))


def default_release() -> str:
    """The release tools/k8s/go.mod builds ("1.37")."""
    match = re.search(r"^\s*k8s\.io/kubernetes v1\.(\d+)\.", DEFAULT_MODULE.read_text(), re.M)
    if not match:
        raise BinariesError(f"{DEFAULT_MODULE} requires no k8s.io/kubernetes v1.x")
    return f"1.{match.group(1)}"


def buildable_releases() -> list[str]:
    """Every release tools/k8s can build, oldest first."""
    pinned = {d.name for d in RELEASES_DIR.glob("1.*") if (d / "go.mod").is_file()}
    return sorted(pinned | {default_release()}, key=lambda r: int(r.split(".")[1]))


def selected_release() -> str | None:
    """The release FLEXGPU_K8S names ("1.34", "v1.34" or "1.34.12" all mean 1.34), or None."""
    raw = os.environ.get(RELEASE_ENV, "").strip()
    if not raw:
        return None
    match = re.fullmatch(r"v?1\.(\d+)(?:\.\d+)?", raw)
    allowed = buildable_releases()
    if not match or f"1.{match.group(1)}" not in allowed:
        raise BinariesError(
            f"{RELEASE_ENV}={raw!r} is not a release tools/k8s builds; allowed: "
            f"{', '.join(allowed)} (pin another with tools/k8s/releases/pin.sh)"
        )
    return f"1.{match.group(1)}"


def expected_minor() -> int:
    """The minor version control_plane_dir() will serve, found without building anything."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and os.access(Path(assets) / "kube-apiserver", os.X_OK):
        return server_minor_version(Path(assets) / "kube-apiserver")
    release = selected_release()
    if release is None:
        on_path = shutil.which("kube-apiserver")
        if on_path and all(shutil.which(n) for n in CONTROL_PLANE):
            minor = server_minor_version(Path(on_path))
            if minor >= 37:
                return minor
        release = default_release()
    return int(release.split(".")[1])


def build(quiet: bool = False, release: str | None = None) -> Path:
    """Runs the build script (a no-op when cached) for ``release`` (default: the selected
    one, else tools/k8s/go.mod's) and returns the folder it filled."""
    if not BUILD_SCRIPT.exists():
        raise BinariesError(f"missing {BUILD_SCRIPT}")
    release = release or selected_release()
    try:
        return buildcache.path("k8s", *([release] if release else []), stream=not quiet)
    except buildcache.BuildError as e:
        raise BinariesError(f"building the control plane failed: {e}") from e


def control_plane_dir() -> Path:
    """The folder holding etcd, kube-apiserver, kube-scheduler, kube-controller-manager."""
    release = selected_release()
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        folder = Path(assets)
        if not _has_all(folder, CONTROL_PLANE):
            raise BinariesError(
                f"KUBEBUILDER_ASSETS={assets} lacks one of {', '.join(CONTROL_PLANE)}; "
                "unset it to build them from tools/k8s"
            )
        minor = server_minor_version(folder / "kube-apiserver")
        if minor < MIN_MINOR:
            raise BinariesError(
                f"KUBEBUILDER_ASSETS holds kube-apiserver 1.{minor}; flexgpu needs 1.{MIN_MINOR}+"
            )
        if release and f"1.{minor}" != release:
            raise BinariesError(
                f"KUBEBUILDER_ASSETS holds kube-apiserver 1.{minor} but {RELEASE_ENV}={release}; "
                "unset one of them"
            )
        return folder
    on_path = [shutil.which(n) for n in CONTROL_PLANE]
    if release is None and all(on_path):
        folder = Path(str(on_path[1])).parent
        apiserver = folder / "kube-apiserver"
        if _has_all(folder, CONTROL_PLANE) and server_minor_version(apiserver) >= 37:
            return folder
    if shutil.which("go") is None:
        raise BinariesError(
            "the Go toolchain is needed to build the local control plane: `make setup` fetches "
            "it (tools/system-deps.sh), or set KUBEBUILDER_ASSETS to a folder with the v1.37 "
            "binaries"
        )
    return build(release=release)


def helm_tools_dir() -> Path:
    """The folder with ``helm`` (v4) and ``kubectl`` (v1.37), fetched on first use."""
    try:
        return buildcache.path("helm", stream=True)
    except buildcache.BuildError as e:
        raise BinariesError(f"fetching helm and kubectl failed: {e}") from e


def harness_binary() -> Path:
    """The kubelet harness, built in the same module and cache as the control plane (of the
    selected release: a kubelet never runs newer than its API server)."""
    path = build() / "kubelet-harness"
    if not os.access(path, os.X_OK):
        raise BinariesError(f"{path} was not built; see tools/k8s/build.sh")
    return path
