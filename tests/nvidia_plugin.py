"""NVIDIA's DRA kubelet plugin for the differential tests (tools/nvidia-driver): built once, then
taken from the cache; without the Go toolchain the tests that need it are skipped."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from tools.nvidia_twin import nvidia_plugin_binary


@functools.cache
def nvidia_binary() -> Path:
    if shutil.which("go") is None:
        pytest.skip("the Go toolchain and a C compiler are needed to build NVIDIA's plugin")
    return nvidia_plugin_binary()
