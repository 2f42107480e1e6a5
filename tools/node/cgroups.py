"""The node's pod cgroups, one folder per hierarchy under this machine's cgroup mount."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")


def hierarchies() -> list[Path]:
    if (CGROUP_MOUNT / "cgroup.controllers").exists():
        return [CGROUP_MOUNT]  # cgroup v2: one hierarchy
    return [p for p in sorted(CGROUP_MOUNT.iterdir()) if p.is_dir() and not p.is_symlink()]


def create(root: str) -> None:
    for hierarchy in hierarchies():
        (hierarchy / root.lstrip("/")).mkdir(exist_ok=True)


def _procs_files(top: Path) -> list[Path]:
    """Every cgroup.procs under ``top``; cgroups that vanish during the walk (the runtime
    removes a stopped container's) are skipped, not an error."""
    found: list[Path] = []
    for dirpath, _, filenames in os.walk(top):
        if "cgroup.procs" in filenames:
            found.append(Path(dirpath) / "cgroup.procs")
    return found


def pids(root: str) -> set[int]:
    found: set[int] = set()
    for hierarchy in hierarchies():
        for procs in _procs_files(hierarchy / root.lstrip("/")):
            with contextlib.suppress(OSError):
                found.update(int(p) for p in procs.read_text().split())
    return found


def kill_all(root: str) -> None:
    """SIGKILLs every process under ``root`` (containers have namespaces of their own, so
    only their cgroups find them all)."""
    for _ in range(5):
        left = pids(root)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def remove(root: str) -> None:
    for hierarchy in hierarchies():
        top = hierarchy / root.lstrip("/")
        if not top.exists():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()
