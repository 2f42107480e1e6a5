"""CPU time and resident memory of a running process, read from /proc."""

from __future__ import annotations

import math
import os
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of every thread of `pid`, in seconds; NaN once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return math.nan
    # The command name (field 2) may hold spaces; the fields after its closing ")" are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _TICKS


def memory_mib(pid: int, field: str = "VmRSS") -> float:
    """A memory field of /proc/<pid>/status (VmRSS: resident now; VmHWM: peak), in MiB;
    NaN once the process has exited (a zombie has no memory lines)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return math.nan
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return math.nan
