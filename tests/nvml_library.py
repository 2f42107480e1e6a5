"""The NVML mock library (tools/nvml-mock): build it, describe a machine for it, load it where
the unmodified ``pynvml`` module finds it, and drive the hardware through its test controls.

``pynvml`` loads ``CDLL("libnvidia-ml.so.1")`` by name. A process started with the library's
folder on ``LD_LIBRARY_PATH`` finds it there; a running test process loads it first under that
soname (``load_into_process``), and the dynamic loader hands pynvml the loaded copy. The library
reads ``FLEXGPU_NVML_MOCK_CONFIG`` and ``FLEXGPU_NVML_MOCK_STATE`` at ``nvmlInit``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools import buildcache

REPO = Path(__file__).resolve().parent.parent
LIBRARY_NAME = "libnvidia-ml.so.1"
ENV_CONFIG = "FLEXGPU_NVML_MOCK_CONFIG"
ENV_STATE = "FLEXGPU_NVML_MOCK_STATE"
ENV_DEV_DIR = "FLEXGPU_NVML_MOCK_DEV_DIR"
NO_INSTANCE = 0xFFFFFFFF


@functools.cache
def library_dir() -> Path:
    """Folder holding the built library (built once, then cached by tools/nvml-mock/build.sh)."""
    if shutil.which("go") is None:
        pytest.skip("the Go toolchain is needed to build the NVML mock library (make setup)")
    return buildcache.path("nvml-mock", timeout=900)


@functools.cache
def load_into_process() -> ctypes.CDLL:
    """Loads the library under its soname, so pynvml's ``CDLL("libnvidia-ml.so.1")`` gets it."""
    lib = ctypes.CDLL(str(library_dir() / LIBRARY_NAME), mode=ctypes.RTLD_GLOBAL)
    for name in ("flexgpuMockInjectXid", "flexgpuMockSetLost", "flexgpuMockSetProcesses"):
        getattr(lib, name).restype = ctypes.c_int
    lib.flexgpuMockInjectXid.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_uint,
        ctypes.c_ulonglong,
        ctypes.c_uint,
        ctypes.c_uint,
    ]
    lib.flexgpuMockSetLost.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_uint,
        ctypes.c_int,
    ]
    lib.flexgpuMockSetProcesses.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_uint,
        ctypes.c_char_p,
    ]
    return lib


@dataclass
class MockMachine:
    """One machine description and its state file; GPU indices are positions in ``gpus``."""

    config_path: Path
    state_path: Path

    @classmethod
    def write(cls, folder: Path, description: dict[str, Any]) -> MockMachine:
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "nvml-machine.json"
        config.write_text(json.dumps(description, indent=1))
        return cls(config_path=config, state_path=folder / "nvml-state.json")

    def env(self) -> dict[str, str]:
        """Variables a process needs to run pynvml on this machine."""
        library = str(library_dir())
        inherited = os.environ.get("LD_LIBRARY_PATH")
        return {
            ENV_CONFIG: str(self.config_path),
            ENV_STATE: str(self.state_path),
            "LD_LIBRARY_PATH": f"{library}:{inherited}" if inherited else library,
        }

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} on {self.config_path}: NVML return code {code}")

    def _paths(self) -> tuple[bytes, bytes]:
        return str(self.config_path).encode(), str(self.state_path).encode()

    def inject_xid(
        self, index: int, xid: int, gpu_instance: int | None = None, compute: int | None = None
    ) -> None:
        gi = NO_INSTANCE if gpu_instance is None else gpu_instance
        ci = NO_INSTANCE if compute is None else compute
        code = load_into_process().flexgpuMockInjectXid(*self._paths(), index, xid, gi, ci)
        self._check(code, f"inject Xid {xid} on GPU {index}")

    def set_lost(self, index: int, lost: bool = True) -> None:
        code = load_into_process().flexgpuMockSetLost(*self._paths(), index, int(lost))
        self._check(code, f"mark GPU {index} lost={lost}")

    def set_processes(self, index: int, processes: list[dict[str, int]]) -> None:
        payload = json.dumps(processes).encode()
        code = load_into_process().flexgpuMockSetProcesses(*self._paths(), index, payload)
        self._check(code, f"set processes on GPU {index}")
