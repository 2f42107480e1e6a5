"""bench/exec_trace.py times programs from the kernel's process events: a program's run is
named by its argv, lasts from its exec to its exit and knows the processes it descends from;
programs not asked for are not kept. Needs root (the proc connector); skipped elsewhere."""

from __future__ import annotations

import os
import subprocess

import pytest

from bench.exec_trace import ExecTraceUnavailable, TraceProcess


@pytest.fixture
def trace() -> TraceProcess:
    try:
        return TraceProcess(["sleep"])
    except ExecTraceUnavailable as err:
        pytest.skip(f"no process events here: {err}")


def test_a_programs_run_is_timed_from_exec_to_exit(trace: TraceProcess) -> None:
    subprocess.run(["sleep", "0.3"], check=True)
    subprocess.run(["true"], check=True)
    recorded = trace.stop()
    runs = [r for r in recorded.runs if r.argv == ("sleep", "0.3")]
    assert len(runs) == 1, recorded
    assert 0.3 <= runs[0].seconds < 3.0
    assert os.getpid() in runs[0].ancestors  # forked from this process
    assert not [r for r in recorded.runs if r.argv[0].endswith("true")]
