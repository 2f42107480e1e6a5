"""NVML-only behaviour: missing library, NOT_SUPPORTED fields, NVLink grouping, sysfs facts,
rollback of half-made MIG devices, time slices through nvidia-smi, error translation."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pynvml
import pytest
from fake_pynvml import FakeGpu, FakeNvml, a100_80gb, t4

from driver.backend_errors import (
    BackendUnavailableError,
    GpuBackendError,
    NotSupportedError,
    PermissionDeniedError,
)
from driver.gpu_model import MigPlacement, TimeSliceInterval
from driver.nvml_backend import NvmlBackend
from driver.nvml_errors import error_for_code, translate_nvml_error
from driver.sysfs import SysfsPci


def _backend(gpus: list[FakeGpu], tmp_path: Path, **kwargs: object) -> NvmlBackend:
    return NvmlBackend(nvml=FakeNvml(gpus), sysfs=SysfsPci(tmp_path / "sys"), **kwargs)  # type: ignore[arg-type]


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-000000000000"


def _bus(i: int) -> str:
    return f"00000000:{0x10 + i:02X}:00.0"


def test_missing_library_is_backend_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="NVML_ERROR_LIBRARY_NOT_FOUND"):
        NvmlBackend(nvml=FakeNvml([], library_present=False))


def test_real_pynvml_without_a_driver_is_backend_unavailable() -> None:
    # On machines without libnvidia-ml this exercises the real module's loader.
    try:
        backend = NvmlBackend()
    except BackendUnavailableError:
        return
    backend.close()  # a real GPU machine: nothing to assert beyond a clean start


def test_unsupported_fields_do_not_fail_enumeration(tmp_path: Path) -> None:
    gpu = t4(_uuid(0), _bus(0))
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


def test_device_node_minor_number_is_reported(tmp_path: Path) -> None:
    gpus = [t4(_uuid(0), _bus(0)), t4(_uuid(1), _bus(1))]
    assert [g.minor_number for g in _backend(gpus, tmp_path).list_gpus()] == [0, 1]


def test_unknown_product_has_no_multiprocessor_count(tmp_path: Path) -> None:
    gpu = t4(_uuid(0), _bus(0))
    gpu.name = "NVIDIA Future GPU"
    assert _backend([gpu], tmp_path).list_gpus()[0].multiprocessors is None


def test_nvswitch_system_is_one_domain(tmp_path: Path) -> None:
    gpus = [a100_80gb(_uuid(i), _bus(i), mig_enabled=False) for i in range(8)]
    for gpu in gpus:
        gpu.nvlink = ["switch"] * 12
    listed = _backend(gpus, tmp_path).list_gpus()
    assert len({g.nvlink_domain for g in listed}) == 1
    assert listed[0].nvlink_peers == (1, 2, 3, 4, 5, 6, 7)


def test_direct_links_group_pairs(tmp_path: Path) -> None:
    gpus = [a100_80gb(_uuid(i), _bus(i), mig_enabled=False) for i in range(4)]
    # 0<->1 over two links, 2<->3 over one; remote addresses as NVML prints them.
    gpus[0].nvlink = [_bus(1), _bus(1), "none"]
    gpus[1].nvlink = [_bus(0), _bus(0), "none"]
    gpus[2].nvlink = ["none", _bus(3)]
    gpus[3].nvlink = [_bus(2), "none"]
    listed = _backend(gpus, tmp_path).list_gpus()
    domains = [g.nvlink_domain for g in listed]
    assert domains[0] == domains[1] != domains[2] == domains[3]
    assert listed[0].nvlink_peers == (1,) and listed[3].nvlink_peers == (2,)


def test_numa_and_pcie_root_from_sysfs(tmp_path: Path) -> None:
    device = tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:10:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    links = tmp_path / "sys" / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:10:00.0").symlink_to(device)
    info = _backend([t4(_uuid(0), _bus(0))], tmp_path).list_gpus()[0]
    assert (info.numa_node, info.pcie_root, info.pci_bus_id) == (1, "pci0000:00", "0000:10:00.0")


def test_gpu_disappearing_mid_enumeration(tmp_path: Path) -> None:
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
    nvml = FakeNvml([a100_80gb(_uuid(0), _bus(0))])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))

    def no_permission(*_: object) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    nvml.nvmlGpuInstanceCreateComputeInstance = no_permission  # type: ignore[method-assign]
    with pytest.raises(PermissionDeniedError, match=r"create 2g\.20gb at 0:2 on GPU 0"):
        backend.create_mig_device(0, 14, MigPlacement(start=0, size=2))
    assert nvml.gpus[0].instances == {}
    assert backend.list_mig_devices(0) == []


def test_half_made_instance_is_listed_without_uuid(tmp_path: Path) -> None:
    nvml = FakeNvml([a100_80gb(_uuid(0), _bus(0))])
    nvml.gpus[0].instances[3] = (nvml.gpus[0].profiles[3], 0, 2, [])  # type: ignore[index]
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))
    (device,) = backend.list_mig_devices(0)
    assert (device.gpu_instance_id, device.uuid, device.compute_instance_id) == (3, None, None)
    backend.destroy_mig_device(0, 3)
    assert nvml.gpus[0].instances == {}


def test_mig_calls_use_profile_ids(tmp_path: Path) -> None:
    nvml = FakeNvml([a100_80gb(_uuid(0), _bus(0))])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))
    device = backend.create_mig_device(0, 15, MigPlacement(start=6, size=2))
    # The fake keys instances by profile id 15 (1g.20gb), not by the enum value 9.
    assert nvml.gpus[0].instances[device.gpu_instance_id][0].id == 15
    assert device.profile_name == "1g.20gb" and device.gpu_instance_id == 6


class _Recorder:
    def __init__(self, result: subprocess.CompletedProcess[str] | Exception) -> None:
        self.result = result
        self.argv: list[str] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.argv = list(argv)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_time_slice_runs_nvidia_smi(tmp_path: Path) -> None:
    runner = _Recorder(subprocess.CompletedProcess([], 0, "", ""))
    backend = _backend([t4(_uuid(0), _bus(0))], tmp_path, run_command=runner)
    backend.set_time_slice(0, TimeSliceInterval.LONG)
    assert runner.argv == ["nvidia-smi", "compute-policy", "-i", _uuid(0), "--set-timeslice=3"]


@pytest.mark.parametrize(
    ("result", "error"),
    [
        (FileNotFoundError("nvidia-smi"), NotSupportedError),
        (subprocess.CompletedProcess([], 4, "", "Insufficient Permissions"), PermissionDeniedError),
        (subprocess.CompletedProcess([], 3, "Not Supported", ""), NotSupportedError),
        (subprocess.CompletedProcess([], 1, "", "boom"), GpuBackendError),
    ],
)
def test_time_slice_failures(
    tmp_path: Path,
    result: subprocess.CompletedProcess[str] | Exception,
    error: type[GpuBackendError],
) -> None:
    backend = _backend([t4(_uuid(0), _bus(0))], tmp_path, run_command=_Recorder(result))
    with pytest.raises(error):
        backend.set_time_slice(0, TimeSliceInterval.SHORT)


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
        (pynvml.NVML_ERROR_UNKNOWN, "GpuBackendError"),
    ],
)
def test_error_translation(code: int, name: str) -> None:
    error = translate_nvml_error(pynvml.NVMLError(code), "op")
    assert type(error).__name__ == name and error.code == code
    assert error_for_code(code, "op").message.startswith("op: NVML_ERROR_")


def test_no_raw_nvml_error_escapes(tmp_path: Path) -> None:
    nvml = FakeNvml([t4(_uuid(0), _bus(0))])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))

    def unknown(*_: object) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    nvml.nvmlDeviceGetComputeMode = unknown  # type: ignore[method-assign]
    with pytest.raises(GpuBackendError) as info:
        backend.get_compute_mode(0)
    assert not isinstance(info.value, pynvml.NVMLError)


def test_process_utilisation_is_merged(tmp_path: Path) -> None:
    from fake_pynvml import fake_process

    nvml = FakeNvml([t4(_uuid(0), _bus(0))])
    nvml.gpus[0].processes = [fake_process(10, 300, sm=55, mem=20), fake_process(11, 100)]
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))
    first, second = backend.process_samples(0)
    assert (first.pid, first.used_memory_mib, first.sm_utilization_percent) == (10, 300, 55)
    assert first.memory_utilization_percent == 20 and first.gpu_instance_id is None
    assert second.sm_utilization_percent == 0
    # Samples already seen are not reported again.
    assert backend.process_samples(0)[0].sm_utilization_percent is None


def test_close_shuts_nvml_down(tmp_path: Path) -> None:
    nvml = FakeNvml([t4(_uuid(0), _bus(0))])
    with NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path)) as backend:
        backend.wait_health_event(0)
    assert not nvml.initialized
    assert "nvmlEventSetFree" in nvml.calls


def test_mps_daemon_is_started_with_the_gpu_pinned_and_adopted_when_alive(
    tmp_path: Path,
) -> None:
    import os
    import subprocess

    calls: list[list[str]] = []

    def runner(argv: list[str]) -> subprocess.CompletedProcess[str]:
        calls.append(list(argv))
        env = dict(a.split("=", 1) for a in argv if "=" in a and a.startswith("CUDA_"))
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
        # The real control daemon writes its pid file; this one is alive (our own pid).
        (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    backend = _backend(
        [t4(_uuid(0), _bus(0))], tmp_path, run_command=runner, mps_root=tmp_path / "mps"
    )
    daemon = backend.start_mps_daemon(0)
    assert calls[0][-1].endswith("exec nvidia-cuda-mps-control -d")
    shm = tmp_path / "mps" / _uuid(0) / "shm"
    assert calls[0][-1].startswith(f"mount --bind {shm} /dev/shm")
    assert f"CUDA_VISIBLE_DEVICES={_uuid(0)}" in calls[0]
    assert daemon.pipe_dir == str(tmp_path / "mps" / _uuid(0) / "pipe")
    assert backend.start_mps_daemon(0) == daemon and len(calls) == 1  # adopted
    assert backend.mps_daemons() == [daemon]
    backend.stop_mps_daemon(0)
    assert calls[1][-3:] == ["sh", "-c", "echo quit | nvidia-cuda-mps-control"]
