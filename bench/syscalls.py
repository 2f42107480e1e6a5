"""Counts chosen system calls of a running process while an action runs, with `strace -c`.

Used outside the timed rounds (tracing slows the traced process). Where strace is missing or
may not attach, the count is None and the benchmark says so."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def parse_summary(text: str) -> dict[str, int]:
    """Calls per syscall from strace's -c table (columns: % time, seconds, usecs/call,
    calls, [errors,] syscall)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) < 5 or not cells[3].isdigit() or cells[-1] == "total":
            continue
        counts[cells[-1]] = int(cells[3])
    return counts


def count_syscalls(
    pid: int, names: Sequence[str], action: Callable[[], None]
) -> dict[str, int] | None:
    """Runs `action` while strace counts `names` in every thread of `pid`."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary"
        tracer = subprocess.Popen(
            [strace, "-f", "-c", "-e", f"trace={','.join(names)}", "-o", str(out), "-p", str(pid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert tracer.stderr is not None
        # strace reports each thread it attaches to; the first line means tracing has begun.
        first = tracer.stderr.readline()
        if "attached" not in first:
            tracer.kill()
            tracer.wait()
            return None
        try:
            action()
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.communicate(timeout=30)
        if not out.exists():
            return None
        counts = parse_summary(out.read_text())
    return {name: counts.get(name, 0) for name in names}
