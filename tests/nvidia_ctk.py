"""NVIDIA Container Toolkit programs for tests (hooks/, what the image ships): built once, then
taken from the cache; and a check that specs load with the upstream CDI library (through
``nvidia-ctk cdi list``, which reads spec folders with tags.cncf.io/container-device-interface)."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tools import buildcache

REPO = Path(__file__).resolve().parent.parent


@functools.cache
def tools_dir() -> Path:
    """Folder with nvidia-ctk, nvidia-cdi-hook, flexgpu-cdi-common and flexgpu-cdi-hooks."""
    if shutil.which("go") is None:
        pytest.skip("the Go toolchain is needed to build nvidia-ctk (make setup)")
    return buildcache.path("hooks", timeout=1200)


def cdi_devices(spec_dir: Path) -> list[str]:
    """Fully qualified names of the devices the CDI library resolves from ``spec_dir``; a spec
    it refuses contributes none (its error is in the log, raised here)."""
    run = subprocess.run(
        [str(tools_dir() / "nvidia-ctk"), "cdi", "list", f"--spec-dir={spec_dir}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if run.returncode != 0 or "level=warning" in run.stderr or "level=error" in run.stderr:
        raise AssertionError(f"the CDI library refused a spec in {spec_dir}:\n{run.stderr}")
    return sorted(line.strip() for line in run.stdout.splitlines() if "=" in line)


def cdi_hook_names(hooks: list[dict[str, Any]]) -> list[str]:
    """The toolkit hooks that OCI or CDI hook entries run, in order: an ``nvidia-cdi-hook``
    entry's subcommand, or each hook a ``flexgpu-cdi-hooks`` entry runs (one JSON list of
    arguments per hook)."""
    names: list[str] = []
    for hook in hooks:
        args = list(hook.get("args") or [])
        if Path(hook["path"]).name == "flexgpu-cdi-hooks":
            names += [json.loads(arg)[0] for arg in args[1:]]
        elif len(args) > 1:
            names.append(args[1])
    return names
