"""Fixtures for the kubelet plugin tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from flexgpu.kubelet_plugin.config import PluginConfig, make_config


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: unix socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="fg-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin_config(short_tmp: Path) -> PluginConfig:
    return make_config(
        node_name="node-a",
        registry_dir=short_tmp / "registry",
        plugins_dir=short_tmp / "plugins",
        cdi_dir=short_tmp / "cdi",
        data_dir=short_tmp / "data",
        health_interval_seconds=0.2,
    )
