"""Fixtures for the tests of kubelet_plugin.kubeletplugin (no GPU driver involved)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexgpu.kubelet_plugin.kubeletplugin import Options


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="kp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def options(short_tmp: Path) -> Options:
    """A driver served from a temp dir, with a short health interval."""
    return Options(
        driver_name="gpu.example.com",
        plugin_data_dir=short_tmp / "plugins" / "gpu.example.com",
        registrar_dir=short_tmp / "registry",
        health_interval_seconds=0.2,
    )
