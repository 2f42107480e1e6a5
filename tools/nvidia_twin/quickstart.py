"""NVIDIA's own quickstart manifests (``demo/specs/quickstart/v1`` of the module
tools/nvidia-driver pins), read from the Go module cache where building NVIDIA's plugin put
the module's source, and flexgpu's copies of them (tests/integration/nvidia_quickstart), which
change only the names a driver owns."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tools import buildcache

NVIDIA_BUILD = buildcache.SCRIPTS["nvidia-driver"]

MODULE = "sigs.k8s.io/dra-driver-nvidia-gpu"
SPECS = Path("demo") / "specs" / "quickstart" / "v1"
FLEXGPU_COPIES = Path(__file__).resolve().parents[2] / "tests" / "integration" / "nvidia_quickstart"
# NVIDIA's names -> flexgpu's: DeviceClasses, the attribute domain (the driver name), the
# opaque config's driver and apiVersion. Nothing else may differ.
RENAMES = {
    "resource.nvidia.com/v1beta1": "gpu.flexgpu.dev/v1alpha1",
    "gpu.nvidia.com": "gpu.flexgpu.dev",
    "mig.nvidia.com": "mig.flexgpu.dev",
}


class QuickstartError(RuntimeError):
    pass


def nvidia_specs() -> Path:
    """The folder of NVIDIA's quickstart manifests in the module cache (``go mod download``
    of the pinned module: already there once NVIDIA's plugin is built; checked against the
    pinned go.sum either way)."""
    proc = subprocess.run(
        ["go", "mod", "download", "-json", MODULE],
        cwd=NVIDIA_BUILD.parent,
        capture_output=True,
        text=True,
        env={**os.environ, "GOSUMDB": "off", "GOFLAGS": "-mod=readonly"},
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise QuickstartError(
            f"go mod download {MODULE} failed (exit {proc.returncode}) in "
            f"{NVIDIA_BUILD.parent}: {(proc.stderr or proc.stdout).strip()[-1000:]}"
        )
    folder = Path(json.loads(proc.stdout)["Dir"]) / SPECS
    if not folder.is_dir():
        raise QuickstartError(f"{MODULE} has no {SPECS} in {folder.parents[3]}")
    return folder


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def renamed(value: Any) -> Any:
    """``value`` (a manifest's data) with NVIDIA's names replaced by flexgpu's, in every
    string (CEL expressions and matchAttribute name the driver's domain)."""
    if isinstance(value, dict):
        return {k: renamed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v) for v in value]
    if isinstance(value, str):
        for theirs, ours in RENAMES.items():
            value = value.replace(theirs, ours)
    return value


def name_changes(nvidia: Path, flexgpu: Path) -> list[str]:
    """Where flexgpu's copy differs from NVIDIA's manifest once NVIDIA's names are renamed
    (comments aside): ``[]`` when only the names differ."""
    theirs, ours = [renamed(d) for d in documents(nvidia)], documents(flexgpu)
    if len(theirs) != len(ours):
        return [f"{len(theirs)} documents in {nvidia.name}, {len(ours)} in {flexgpu}"]
    return [
        f"document {i} ({a.get('kind')} {a.get('metadata', {}).get('name')}) differs"
        for i, (a, b) in enumerate(zip(theirs, ours, strict=True))
        if a != b
    ]
