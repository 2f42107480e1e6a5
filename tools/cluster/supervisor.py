"""The background supervisor that keeps a local cluster (or the demo) running after the
command that started it returns: its pid file, and stopping it (its children die with it)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PID_FILE = "supervisor.pid"


def supervisor_pid(workdir: Path) -> int | None:
    """The running supervisor's pid, or None."""
    try:
        pid = int((workdir / PID_FILE).read_text())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


def stop_supervisor(workdir: Path, timeout_s: float = 60) -> bool:
    """SIGTERM and wait until it is gone; False when none was running."""
    pid = supervisor_pid(workdir)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    (workdir / PID_FILE).unlink(missing_ok=True)
    return True
