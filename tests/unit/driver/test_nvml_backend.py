"""NVML error paths that the NVML mock library cannot produce, on the Python stand-in for pynvml
(fake_pynvml), and NVML error translation. Everything else the NVML backend does is tested over
the library: test_backend_contract.py and test_nvml_on_library.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from fake_pynvml import FakeNvml, a100_80gb, t4

from flexgpu.driver.backend_errors import BackendUnavailableError, PermissionDeniedError
from flexgpu.driver.gpu_model import MigPlacement
from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.driver.nvml_errors import error_for_code, translate_nvml_error
from flexgpu.driver.sysfs import SysfsPci

REPO = Path(__file__).resolve().parents[3]


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-000000000000"


def _bus(i: int) -> str:
    return f"00000000:{0x10 + i:02X}:00.0"


def test_missing_library_is_backend_unavailable() -> None:
    # Stand-in only: once the mock library is loaded into the test process it cannot be absent.
    with pytest.raises(BackendUnavailableError, match="NVML_ERROR_LIBRARY_NOT_FOUND"):
        NvmlBackend(nvml=FakeNvml([], library_present=False))


# Runs in a fresh interpreter: the test process may have the mock NVML library loaded, and
# a GPU machine has the real one; here the dynamic loader is made to fail for libnvidia-ml
# (before pynvml binds ctypes.CDLL), so the real pynvml loader takes its not-found path.
_NO_DRIVER = """
import ctypes
real = ctypes.CDLL
def no_nvml(name, *args, **kwargs):
    if "nvidia-ml" in str(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")
    return real(name, *args, **kwargs)
ctypes.CDLL = no_nvml
from flexgpu.driver.backend_errors import BackendUnavailableError
from flexgpu.driver.nvml_backend import NvmlBackend
try:
    NvmlBackend()
except BackendUnavailableError as err:
    print("UNAVAILABLE", err)
else:
    print("STARTED")
"""


def test_real_pynvml_without_a_driver_is_backend_unavailable() -> None:
    """The real pynvml module, with no libnvidia-ml to load: BackendUnavailableError naming
    NVML's library-not-found error, not a crash and not a backend without GPUs."""
    result = subprocess.run(
        [sys.executable, "-c", _NO_DRIVER],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("UNAVAILABLE"), result.stdout
    assert "NVML_ERROR_LIBRARY_NOT_FOUND" in result.stdout


def test_unsupported_fields_do_not_fail_enumeration(tmp_path: Path) -> None:
    gpu = t4(_uuid(0), _bus(0))
    # Stand-in only: every GPU the mock library models reports brand, architecture and minor.
    nvml = FakeNvml([gpu])

    def unsupported(*_: object) -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nvml.nvmlDeviceGetBrand = unsupported  # type: ignore[method-assign]
    nvml.nvmlDeviceGetArchitecture = unsupported  # type: ignore[method-assign]
    nvml.nvmlDeviceGetMinorNumber = unsupported  # type: ignore[method-assign]
    info = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path)).list_gpus()[0]
    assert (info.brand, info.architecture) == ("Unknown", "Unknown")
    assert info.minor_number is None
    assert info.mig_capable is False and info.numa_node is None and info.pcie_root is None
    assert info.product_name == "Tesla T4"


def test_gpu_disappearing_mid_enumeration(tmp_path: Path) -> None:
    # Stand-in only: a loss between two calls of one enumeration needs a hook inside a call.
    nvml = FakeNvml([t4(_uuid(0), _bus(0)), t4(_uuid(1), _bus(1))])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))
    assert len(backend.list_gpus()) == 2
    original = nvml.nvmlDeviceGetName

    def vanish_during_read(handle: object) -> str:
        # GPU 1 falls off the bus while GPU 0 is being read; its own handle lookup then fails.
        nvml.gpus[1].lost = True
        return original(handle)

    nvml.nvmlDeviceGetName = vanish_during_read  # type: ignore[method-assign]
    assert [g.index for g in backend.list_gpus()] == [0]
    event = backend.wait_health_event(0)
    assert event is not None and event.gpu_uuid == _uuid(1) and event.gpu_index == 1
    assert backend.wait_health_event(0) is None


def test_failed_compute_instance_rolls_back_gpu_instance(tmp_path: Path) -> None:
    # Stand-in only: the mock library never refuses a compute instance in a fresh GPU instance.
    nvml = FakeNvml([a100_80gb(_uuid(0), _bus(0))])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))

    def no_permission(*_: object) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    nvml.nvmlGpuInstanceCreateComputeInstance = no_permission  # type: ignore[method-assign]
    with pytest.raises(PermissionDeniedError, match=r"create 2g\.20gb at 0:2 on GPU 0"):
        backend.create_mig_device(0, 14, MigPlacement(start=0, size=2))
    assert nvml.gpus[0].instances == {}
    assert backend.list_mig_devices(0) == []


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (pynvml.NVML_ERROR_NOT_SUPPORTED, "NotSupportedError"),
        (pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, "InsufficientResourcesError"),
        (pynvml.NVML_ERROR_IN_USE, "InUseError"),
        (pynvml.NVML_ERROR_NOT_FOUND, "NotFoundError"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "PermissionDeniedError"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "GpuLostError"),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, "InvalidArgumentError"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "BackendUnavailableError"),
        (pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH, "BackendUnavailableError"),
        (pynvml.NVML_ERROR_UNKNOWN, "GpuBackendError"),
    ],
)
def test_error_translation(code: int, name: str) -> None:
    error = translate_nvml_error(pynvml.NVMLError(code), "op")
    assert type(error).__name__ == name and error.code == code
    assert error_for_code(code, "op").message.startswith("op: NVML_ERROR_")
