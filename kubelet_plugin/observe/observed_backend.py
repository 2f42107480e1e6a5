"""A GpuBackend that counts what the plugin does to the hardware, for the plugin's metrics:
MIG instances created and destroyed, MPS daemons started and stopped, and the health events
(Xids, lost GPUs) the health monitor receives. Every call goes to the real backend unchanged;
counting happens around it, so the rest of the plugin needs no edits to be observed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from flexgpu.driver.backend import GpuBackend
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
from flexgpu.driver.usage import GpuUsage
from flexgpu.kubelet_plugin.observe import metrics

T = TypeVar("T")


class ObservedBackend(GpuBackend):
    def __init__(self, inner: GpuBackend, node_name: str) -> None:
        self.inner = inner
        self._node = node_name

    def _count(self, counter: Callable[[str], None], call: Callable[[], T]) -> T:
        try:
            result = call()
        except Exception:
            counter("error")
            raise
        counter("ok")
        return result

    # -- counted -------------------------------------------------------------------------
    def create_mig_device(self, index: int, profile_id: int, placement: MigPlacement) -> MigDevice:
        device: list[MigDevice] = []

        def count(result: str) -> None:
            profile = device[0].profile_name if device else str(profile_id)
            metrics.mig_operation(self._node, "create", profile, result)

        def call() -> MigDevice:
            device.append(self.inner.create_mig_device(index, profile_id, placement))
            return device[0]

        return self._count(count, call)

    def destroy_mig_device(self, index: int, gpu_instance_id: int) -> None:
        profile = next(
            (
                m.profile_name
                for m in self._quiet_mig_devices(index)
                if m.gpu_instance_id == gpu_instance_id
            ),
            "",
        )
        self._count(
            lambda result: metrics.mig_operation(self._node, "destroy", profile, result),
            lambda: self.inner.destroy_mig_device(index, gpu_instance_id),
        )

    def _quiet_mig_devices(self, index: int) -> list[MigDevice]:
        try:
            return self.inner.list_mig_devices(index)
        except Exception:  # only for the profile label; the destroy itself reports errors
            return []

    def start_mps_daemon(self, index: int) -> MpsDaemon:
        return self._count(
            lambda result: metrics.mps_operation(self._node, "start", result),
            lambda: self.inner.start_mps_daemon(index),
        )

    def stop_mps_daemon(self, index: int) -> None:
        self._count(
            lambda result: metrics.mps_operation(self._node, "stop", result),
            lambda: self.inner.stop_mps_daemon(index),
        )

    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        return self._count(
            lambda result: metrics.mps_operation(self._node, "start", result),
            lambda: self.inner.start_mig_mps_daemon(spec),
        )

    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        self._count(
            lambda result: metrics.mps_operation(self._node, "stop", result),
            lambda: self.inner.stop_mig_mps_daemon(parent_index, uuid),
        )

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        event = self.inner.wait_health_event(timeout_s)
        if event is not None:
            metrics.health_event(self._node, event)
        return event

    # -- passed through ------------------------------------------------------------------
    def list_gpus(self) -> list[GpuInfo]:
        return self.inner.list_gpus()

    def get_mig_mode(self, index: int) -> MigMode:
        return self.inner.get_mig_mode(index)

    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        return self.inner.set_mig_mode(index, enabled)

    def mig_profiles(self, index: int) -> list[MigProfile]:
        return self.inner.mig_profiles(index)

    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        return self.inner.possible_placements(index, profile_id)

    def list_mig_devices(self, index: int) -> list[MigDevice]:
        return self.inner.list_mig_devices(index)

    def get_compute_mode(self, index: int) -> ComputeMode:
        return self.inner.get_compute_mode(index)

    def set_compute_mode(self, index: int, mode: ComputeMode) -> None:
        self.inner.set_compute_mode(index, mode)

    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        self.inner.set_time_slice(index, interval)

    def mps_daemons(self) -> list[MpsDaemon]:
        return self.inner.mps_daemons()

    def process_samples(self, index: int) -> list[ProcessSample]:
        return self.inner.process_samples(index)

    def gpu_usage(self, index: int) -> GpuUsage:
        return self.inner.gpu_usage(index)

    def close(self) -> None:
        self.inner.close()
