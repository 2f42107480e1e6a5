"""The one interface through which flexgpu reaches GPU hardware.

Implemented by the NVML backend (real nodes) and the simulated backend (development, tests,
demos). Every method raises only the typed errors of ``driver.backend_errors``. GPUs are named
by their enumeration index, as NVML numbers them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import ClassVar, Self

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
from flexgpu.driver.usage import GpuUsage, usage_from_processes


class GpuBackend(ABC):
    """Hardware access for one node."""

    # Methods that change GPU state; a read-only wrapper must refuse exactly these.
    MUTATING_METHODS: ClassVar[frozenset[str]] = frozenset(
        {
            "set_mig_mode",
            "create_mig_device",
            "destroy_mig_device",
            "set_compute_mode",
            "set_time_slice",
            "start_mps_daemon",
            "stop_mps_daemon",
            "start_mig_mps_daemon",
            "stop_mig_mps_daemon",
        }
    )

    @abstractmethod
    def list_gpus(self) -> list[GpuInfo]:
        """Every reachable GPU, by index. A GPU that fell off the bus is left out (and reported
        once through :meth:`wait_health_event`); one field NVML cannot read does not drop it."""

    @abstractmethod
    def get_mig_mode(self, index: int) -> MigMode:
        """Current and pending MIG mode. NotSupportedError on a GPU without MIG."""

    @abstractmethod
    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        """Request a MIG mode. InUseError while MIG instances or processes exist."""

    @abstractmethod
    def mig_profiles(self, index: int) -> list[MigProfile]:
        """GPU instance profiles with their possible placements. NotSupportedError without MIG."""

    @abstractmethod
    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        """Every placement the profile allows, occupied or not."""

    @abstractmethod
    def create_mig_device(self, index: int, profile_id: int, placement: MigPlacement) -> MigDevice:
        """Create a GPU instance at ``placement`` and one compute instance spanning it.

        Returns the new device with its ``MIG-`` UUID. NotSupportedError when MIG is disabled,
        InsufficientResourcesError on overlap or when the profile's instance limit is reached,
        InvalidArgumentError for an unknown profile or a placement the profile does not offer.
        """

    @abstractmethod
    def destroy_mig_device(self, index: int, gpu_instance_id: int) -> None:
        """Destroy a GPU instance and its compute instances. NotFoundError if it does not
        exist, InUseError while processes run on it."""

    @abstractmethod
    def list_mig_devices(self, index: int) -> list[MigDevice]:
        """Existing GPU instances; empty on a GPU without MIG or with MIG disabled."""

    @abstractmethod
    def get_compute_mode(self, index: int) -> ComputeMode: ...

    @abstractmethod
    def set_compute_mode(self, index: int, mode: ComputeMode) -> None: ...

    @abstractmethod
    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        """Set the time-slice length used when several processes share the GPU."""

    @abstractmethod
    def start_mps_daemon(self, index: int) -> MpsDaemon:
        """Start the MPS control daemon for this GPU, or return the one already running (a
        restarted plugin adopts it instead of starting a second). The GPU is put in
        exclusive-process compute mode, so every CUDA process goes through the daemon."""

    @abstractmethod
    def stop_mps_daemon(self, index: int) -> None:
        """Stop the GPU's MPS daemon and restore the default compute mode; no-op if none."""

    @abstractmethod
    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        """Start the MPS control daemon of a claim's MIG devices, or return the one already
        running under ``spec.key``. It sees only ``spec.device_uuids`` and gets the claim's
        limits as its defaults (``spec.control_commands()``). The parent GPU's compute mode
        is left as it is: its other partitions belong to other claims. The daemon returned
        has ``gpu_index`` = ``spec.parent_index`` and ``gpu_uuid`` = ``spec.key``.
        NotFoundError when a UUID is not a MIG device of this node."""

    @abstractmethod
    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        """Stop the MIG device daemon keyed by ``uuid``; no-op if none runs. Nothing else
        changes on the parent GPU."""

    @abstractmethod
    def mps_daemons(self) -> list[MpsDaemon]:
        """MPS daemons running on this node: one per whole GPU that has one, and one per
        claim's MIG device set (``driver.mps_daemon_spec.serves_mig`` tells them apart)."""

    @abstractmethod
    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        """Block up to ``timeout_s`` for the next health event (Xid, GPU lost); ``None`` if none
        arrived."""

    @abstractmethod
    def process_samples(self, index: int) -> list[ProcessSample]:
        """Processes on the GPU with the memory they hold and recent utilisation."""

    def gpu_usage(self, index: int) -> GpuUsage:
        """SM utilisation, memory in use and processes of the GPU and of each MIG instance.

        This default builds it from :meth:`process_samples` and the GPU's MIG instances;
        backends that can read device-level figures override it."""
        instances = [m.gpu_instance_id for m in self.list_mig_devices(index)]
        return usage_from_processes(index, self.process_samples(index), instances)

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op for backends holding nothing
        """Release library handles. The backend must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
