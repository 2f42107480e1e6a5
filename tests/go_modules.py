"""Upstream Go modules for the tests that hold flexgpu to upstream's definitions (the kubelet's
.proto files, the device metadata API): where the module cache is, and which version of a
module tools/k8s/go.mod pins (tools/k8s/build.sh downloads them)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GO_MOD = REPO / "tools" / "k8s" / "go.mod"


def go_module_cache() -> Path:
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    go = shutil.which("go")
    if go:
        out = subprocess.run([go, "env", "GOMODCACHE"], check=False, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    gopath = os.environ.get("GOPATH") or str(Path.home() / "go")
    return Path(gopath.split(os.pathsep)[0]) / "pkg" / "mod"


def pinned_version(module: str, go_mod: Path = GO_MOD) -> str:
    """The version the ``<module> => <module> vX`` replace line of go.mod pins."""
    name = re.escape(module)
    match = re.search(rf"^\s*{name}\s*=>\s*{name}\s+(v\S+)", go_mod.read_text(), re.M)
    if not match:
        pytest.fail(f"{go_mod} has no '{module} => {module} vX' replace line")
    return match.group(1)


def module_dir(module: str) -> Path:
    """The pinned version's folder in the module cache (it may be missing). Module paths with
    capital letters are escaped in the cache; Kubernetes' have none."""
    return go_module_cache() / f"{module}@{pinned_version(module)}"
