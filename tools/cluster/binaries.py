"""Finds the control-plane binaries: KUBEBUILDER_ASSETS, then v1.37+ binaries on PATH, then
the build cache (building on a miss with tools/k8s/build.sh), so a warm start costs nothing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "tools" / "k8s" / "build.sh"
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


def build(quiet: bool = False) -> Path:
    """Runs the build script (a no-op when cached) and returns the folder it filled."""
    if not BUILD_SCRIPT.exists():
        raise BinariesError(f"missing {BUILD_SCRIPT}")
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else sys.stderr,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BinariesError(
            f"building the control plane failed (exit {proc.returncode}); "
            f"run `bash {BUILD_SCRIPT}` to see the full output"
        )
    return Path(proc.stdout.strip().splitlines()[-1])


def control_plane_dir() -> Path:
    """The folder holding etcd, kube-apiserver, kube-scheduler, kube-controller-manager."""
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
        return folder
    on_path = [shutil.which(n) for n in CONTROL_PLANE]
    if all(on_path):
        folder = Path(str(on_path[1])).parent
        apiserver = folder / "kube-apiserver"
        if _has_all(folder, CONTROL_PLANE) and server_minor_version(apiserver) >= 37:
            return folder
    if shutil.which("go") is None:
        raise BinariesError(
            "the Go toolchain is needed to build the local control plane: install go 1.26+ "
            "or set KUBEBUILDER_ASSETS to a folder with the v1.37 binaries"
        )
    return build()


HELM_SCRIPT = REPO_ROOT / "tools" / "helm" / "fetch.sh"


def helm_tools_dir() -> Path:
    """The folder with ``helm`` (v4) and ``kubectl`` (v1.37), fetched on first use."""
    proc = subprocess.run(
        ["bash", str(HELM_SCRIPT)],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if proc.returncode != 0:
        raise BinariesError(f"fetching helm and kubectl failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def harness_binary() -> Path:
    """The kubelet harness, built in the same module and cache as the control plane."""
    path = build() / "kubelet-harness"
    if not os.access(path, os.X_OK):
        raise BinariesError(f"{path} was not built; see tools/k8s/build.sh")
    return path
