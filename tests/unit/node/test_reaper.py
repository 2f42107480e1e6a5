"""Only nodes whose namespace holder is gone count as leftovers."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tools.node import reaper


def test_stale_only_when_the_holder_is_gone(tmp_path: Path) -> None:
    holder = subprocess.Popen(["sleep", "60"])
    try:
        live, dead, unstarted = (tmp_path / f"fgn-{n}" for n in ("live", "dead", "new"))
        for root in (live, dead, unstarted):
            root.mkdir()
        (live / reaper.PID_FILE).write_text(f"{holder.pid}\n")
        gone = subprocess.Popen(["true"])
        gone.wait()
        (dead / reaper.PID_FILE).write_text(f"{gone.pid}\n")
        assert reaper.stale_roots(tmp_path) == [dead]
    finally:
        holder.kill()
        holder.wait()
    assert reaper.stale_roots(tmp_path) == [dead, live]
