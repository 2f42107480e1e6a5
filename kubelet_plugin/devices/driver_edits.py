"""The CDI edits every GPU container needs, from NVIDIA's own generator, once per plugin start.

``flexgpu-cdi-common`` (hooks/, shipped in the image beside ``nvidia-ctk`` and
``nvidia-cdi-hook``) runs the NVIDIA Container Toolkit's generator over the driver root and
prints the common edits: driver libraries and programs, IPC sockets, firmware, the hooks that
create the driver's symlinks and refresh the linker cache, and the control device nodes. The
plugin merges them into every claim's spec.

Paths are rewritten from where the plugin sees the driver root to where the host has it,
since the container runtime applies the spec on the host. The hooks run ``nvidia-cdi-hook`` on
the host: the plugin installs the image's copy into its data folder, which has the same path on
the host and in its container, unless a host path is configured.

Those hooks run on every container start, one program start each. ``flexgpu-cdi-hooks``
(hooks/, beside ``nvidia-cdi-hook`` in the image) runs the toolkit's same hook code
for several of them in one process, so consecutive hooks of one stage become one
(combine_hooks): the container receives exactly what the separate hooks gave it.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexgpu.driver.atomic_file import atomic_write_bytes
from flexgpu.driver.preflight import LIBRARY_DIRS, NVML_LIBRARY, find_nvml

log = logging.getLogger(__name__)

GENERATOR = "flexgpu-cdi-common"
HOOK = "nvidia-cdi-hook"
COMBINED_HOOK = "flexgpu-cdi-hooks"
_EDIT_KEYS = frozenset({"env", "deviceNodes", "hooks", "mounts", "additionalGids", "intelRdt"})


class DriverEditsError(RuntimeError):
    """The driver's edits cannot be generated; the message names the setting to fix."""


def load_nvml(driver_root: Path) -> Path:
    """Loads the driver root's NVML library by its path, so that pynvml's later load by name
    finds it; the driver root's other libraries (the host's libc, ...) stay out of this
    process, which LD_LIBRARY_PATH would not ensure."""
    path = find_nvml(driver_root)
    if path is None:
        raise DriverEditsError(
            f"--driver-root (FLEXGPU_DRIVER_ROOT) {driver_root}: no {NVML_LIBRARY} in "
            f"{', '.join(LIBRARY_DIRS)}; set it (chart: kubeletPlugin.nvidiaDriverRoot) to the "
            "folder the NVIDIA driver is installed under"
        )
    try:
        ctypes.CDLL(os.fspath(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        raise DriverEditsError(
            f"--driver-root (FLEXGPU_DRIVER_ROOT) {driver_root}: cannot load {path}: {err}"
        ) from None
    log.info("NVML from %s", path)
    return path


def install_hook(data_dir: Path, source: str = HOOK) -> Path:
    """Copies ``nvidia-cdi-hook`` (from PATH) to ``<data dir>/bin``, replacing an older copy
    atomically, so a running container's hook is never a half-written file."""
    found = shutil.which(source)
    if found is None:
        raise DriverEditsError(
            f"--nvidia-cdi-hook (FLEXGPU_NVIDIA_CDI_HOOK) is unset and {source!r} is not in "
            f"PATH ({os.environ.get('PATH', '')}); set it to the host path of nvidia-cdi-hook "
            "(NVIDIA Container Toolkit 1.17 or newer installs /usr/bin/nvidia-cdi-hook), or "
            "use the flexgpu image, which ships it"
        )
    return _install(Path(found), data_dir / "bin" / HOOK)


def install_combined_hook(data_dir: Path, source: str = COMBINED_HOOK) -> Path | None:
    """Copies ``flexgpu-cdi-hooks`` (from PATH) to ``<data dir>/bin`` as install_hook does;
    None where it is not in PATH (the hooks then stay separate, as NVIDIA's generator wrote
    them)."""
    found = shutil.which(source)
    if found is None:
        log.info("%s is not in PATH: each CDI hook runs as a program of its own", source)
        return None
    return _install(Path(found), data_dir / "bin" / COMBINED_HOOK)


def _install(source: Path, target: Path) -> Path:
    data = source.read_bytes()
    if not target.exists() or target.read_bytes() != data:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(target, data, mode=0o755)
    return target


def combine_hooks(edits: Mapping[str, Any], hook_path: Path, combined: Path) -> dict[str, Any]:
    """The edits with each run of two or more consecutive ``nvidia-cdi-hook`` hooks of one
    stage (same environment, no timeout) replaced by one ``flexgpu-cdi-hooks`` hook that runs
    them in the same order, each hook's arguments one JSON list. A hook with a timeout, or of
    another program, stays as it is and ends the run (the order of hooks is kept)."""
    result = dict(edits)
    hooks: list[dict[str, Any]] = []
    run: list[Mapping[str, Any]] = []

    def flush() -> None:
        if len(run) == 1:
            hooks.append(dict(run[0]))
        elif run:
            merged: dict[str, Any] = {
                "hookName": run[0]["hookName"],
                "path": os.fspath(combined),
                "args": [COMBINED_HOOK, *(json.dumps(list(h["args"][1:])) for h in run)],
            }
            if run[0].get("env"):
                merged["env"] = list(run[0]["env"])
            hooks.append(merged)
        run.clear()

    for hook in edits.get("hooks") or []:
        joins = (
            hook.get("path") == os.fspath(hook_path)
            and len(hook.get("args") or []) >= 2
            and hook.get("timeout") is None
        )
        if not joins:
            flush()
            hooks.append(dict(hook))
            continue
        if run and (
            run[0]["hookName"] != hook.get("hookName") or run[0].get("env") != hook.get("env")
        ):
            flush()
        run.append(hook)
    flush()
    if hooks:
        result["hooks"] = hooks
    return result


def generate(
    *,
    driver_root: Path,
    host_driver_root: Path,
    hook_path: Path,
    generator: str = GENERATOR,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Runs the generator and returns the edits with host paths."""
    found = shutil.which(generator)
    if found is None:
        raise DriverEditsError(
            f"--cdi-generator (FLEXGPU_CDI_GENERATOR): {generator!r} is not an executable "
            f"file nor in PATH; it generates the driver's CDI edits (libraries, programs, "
            f"hooks, control devices) over --driver-root {driver_root}. The flexgpu image "
            "ships it; elsewhere build it with hooks/build.sh, or unset "
            "--driver-root to write specs with device nodes only (containers then get no "
            "driver libraries)"
        )
    command = [
        found,
        f"--driver-root={driver_root}",
        f"--nvidia-cdi-hook-path={hook_path}",
    ]
    try:
        run = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DriverEditsError(f"running {found}: {err}") from None
    if run.returncode != 0:
        raise DriverEditsError(
            f"{found} failed (exit {run.returncode}) over --driver-root {driver_root}: "
            f"{run.stderr.strip()[-2000:]}"
        )
    try:
        edits = json.loads(run.stdout)
    except ValueError as err:
        raise DriverEditsError(f"{found} printed no JSON: {err}") from None
    if not isinstance(edits, dict) or not set(edits) <= _EDIT_KEYS:
        raise DriverEditsError(
            f"{found} printed {type(edits).__name__} with keys "
            f"{sorted(edits) if isinstance(edits, dict) else '-'}; expected CDI container "
            f"edits ({', '.join(sorted(_EDIT_KEYS))})"
        )
    edits = rebase(edits, driver_root, host_driver_root)
    log.info(
        "driver edits from %s over %s: %d mount(s), %d hook(s), %d device node(s)",
        found,
        driver_root,
        len(edits.get("mounts") or []),
        len(edits.get("hooks") or []),
        len(edits.get("deviceNodes") or []),
    )
    return edits


def rebase(edits: Mapping[str, Any], root: Path, host_root: Path) -> dict[str, Any]:
    """Host paths under ``root`` (the plugin's view) moved under ``host_root``."""
    if root == host_root:
        return dict(edits)

    def moved(path: str) -> str:
        try:
            rest = Path(path).relative_to(root)
        except ValueError:
            return path
        return os.fspath(host_root / rest)

    result = dict(edits)
    result["mounts"] = [
        {**m, "hostPath": moved(str(m.get("hostPath", "")))} for m in edits.get("mounts") or []
    ]
    result["deviceNodes"] = [
        {**n, "hostPath": moved(str(n["hostPath"]))} if n.get("hostPath") else dict(n)
        for n in edits.get("deviceNodes") or []
    ]
    return {k: v for k, v in result.items() if v}
