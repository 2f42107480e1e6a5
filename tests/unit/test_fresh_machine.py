"""tools/fresh-machine/run.sh, which runs the README's commands in a fresh Debian root
filesystem: it refuses what it does not run, naming what it does, and never removes a root
filesystem another run is still using (its mounts are in that run's own namespace, so the
run's lock file is what says so). The runs themselves take minutes and the network; their
figures are in docs/development.md."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "fresh-machine" / "run.sh"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        check=False,
    )


def test_an_unknown_run_is_refused_with_the_allowed_ones() -> None:
    result = _run(["test"], {})
    assert result.returncode == 2
    assert "go|demo" in result.stderr and "'test'" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="the script runs only as root")
def test_a_root_filesystem_in_use_is_left_alone(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs-go"
    (rootfs / "root").mkdir(parents=True)
    with (tmp_path / "rootfs-go.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = _run(["go"], {"FLEXGPU_FRESH_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert f"still using {rootfs}" in result.stderr
    assert (rootfs / "root").is_dir()
