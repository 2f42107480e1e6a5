"""promtool (Debian's prometheus package; `make test` installs it) for tests that check metrics
and rules the way Prometheus does."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def promtool_path() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is missing: `make test` installs it (tools/system-deps.sh test)")
    return found


def check_metrics(text: bytes) -> None:
    """Fails with promtool's findings unless the exposition text passes
    ``promtool check metrics`` without a single remark."""
    result = subprocess.run(
        [promtool_path(), "check", "metrics"], input=text, capture_output=True, check=False
    )
    output = (result.stdout + result.stderr).decode()
    assert result.returncode == 0 and not output.strip(), output
