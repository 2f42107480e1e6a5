"""A backend wrapper that can only read: for inventory listings and checks on real machines,
where changing a GPU setting (MIG mode, instances, compute mode, time slice) is never wanted."""

from __future__ import annotations

from typing import NoReturn

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import ReadOnlyViolationError
from flexgpu.driver.gpu_model import (
    ComputeMode,
    GpuInfo,
    HealthEvent,
    MigDevice,
    MigMode,
    MigPlacement,
    MigProfile,
    MpsDaemon,
    ProcessSample,
    TimeSliceInterval,
)
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec


class ReadOnlyBackend(GpuBackend):
    """Delegates reads to ``inner``; every mutating method raises before reaching it."""

    def __init__(self, inner: GpuBackend) -> None:
        self._inner = inner

    def _refuse(self, method: str) -> NoReturn:
        raise ReadOnlyViolationError(f"{method} refused: backend is read-only")

    def list_gpus(self) -> list[GpuInfo]:
        return self._inner.list_gpus()

    def get_mig_mode(self, index: int) -> MigMode:
        return self._inner.get_mig_mode(index)

    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        self._refuse("set_mig_mode")

    def mig_profiles(self, index: int) -> list[MigProfile]:
        return self._inner.mig_profiles(index)

    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        return self._inner.possible_placements(index, profile_id)

    def create_mig_device(self, index: int, profile_id: int, placement: MigPlacement) -> MigDevice:
        self._refuse("create_mig_device")

    def destroy_mig_device(self, index: int, gpu_instance_id: int) -> None:
        self._refuse("destroy_mig_device")

    def list_mig_devices(self, index: int) -> list[MigDevice]:
        return self._inner.list_mig_devices(index)

    def get_compute_mode(self, index: int) -> ComputeMode:
        return self._inner.get_compute_mode(index)

    def set_compute_mode(self, index: int, mode: ComputeMode) -> None:
        self._refuse("set_compute_mode")

    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        self._refuse("set_time_slice")

    def start_mps_daemon(self, index: int) -> MpsDaemon:
        self._refuse("start_mps_daemon")

    def stop_mps_daemon(self, index: int) -> None:
        self._refuse("stop_mps_daemon")

    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        self._refuse("start_mig_mps_daemon")

    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        self._refuse("stop_mig_mps_daemon")

    def mps_daemons(self) -> list[MpsDaemon]:
        return self._inner.mps_daemons()

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        return self._inner.wait_health_event(timeout_s)

    def process_samples(self, index: int) -> list[ProcessSample]:
        return self._inner.process_samples(index)

    def close(self) -> None:
        self._inner.close()
