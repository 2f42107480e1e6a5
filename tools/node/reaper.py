"""Removes what a real node killed without its cleanup left behind: the shims and
containers outlive a SIGKILLed test run (they are no children of it), with their pod
cgroups and files. A node is stale when the process holding its namespaces is gone."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from tools.node import cgroups

PID_FILE = "namespace.pid"
ROOT_PREFIX = "fgn-"


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"sleep" in cmdline  # the holder execs sleep; a reused pid runs something else


def stale_roots(base: Path = Path("/tmp")) -> list[Path]:
    stale = []
    for root in sorted(base.glob(f"{ROOT_PREFIX}*")):
        try:
            pid = int((root / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            continue  # never started, or not a node root of ours: leave it
        if not _alive(pid):
            stale.append(root)
    return stale


def _shims_of(root: Path) -> list[int]:
    socket = f"{root}/run/containerd.sock".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and socket in argv:
                found.append(int(entry.name))
    return found


def reap_stale_nodes(base: Path = Path("/tmp")) -> list[Path]:
    """Kills the leftovers of every stale node under ``base``; returns their roots."""
    reaped = stale_roots(base)
    for root in reaped:
        cgroup_root = f"/flexgpu-node-{root.name}"
        cgroups.kill_all(cgroup_root)
        for pid in _shims_of(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        cgroups.remove(cgroup_root)
        shutil.rmtree(root, ignore_errors=True)
    return reaped
