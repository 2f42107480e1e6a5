"""Typed model of the GPU hardware a node exposes: whole GPUs, MIG profiles, placements, MIG
devices, health events and per-process samples. Both backends return these models."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class HealthState(StrEnum):
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


class ComputeMode(StrEnum):
    """NVML compute modes still supported by current drivers."""

    DEFAULT = "Default"
    EXCLUSIVE_PROCESS = "ExclusiveProcess"
    PROHIBITED = "Prohibited"


class TimeSliceInterval(StrEnum):
    """Time-slice lengths the driver's compute policy offers (nvidia-smi --set-timeslice 0..3)."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"


class MigMode(_Frozen):
    """MIG mode as NVML reports it: ``pending`` differs from ``current`` until a GPU reset."""

    current: bool
    pending: bool


class GpuInfo(_Frozen):
    """One physical GPU. Fields NVML cannot report on a given GPU are ``None``."""

    index: int = Field(ge=0)
    uuid: str
    product_name: str
    brand: str
    architecture: str
    cuda_compute_capability: str
    driver_version: str
    cuda_driver_version: str
    memory_mib: int = Field(ge=0)
    multiprocessors: int | None = None
    pci_bus_id: str
    pcie_root: str | None = None
    numa_node: int | None = None
    # Minor number of /dev/nvidia<N>; unknown on simulated GPUs, which have no device node.
    minor_number: int | None = None
    # Indices of GPUs on this node with a direct or NVSwitch-routed NVLink path to this one.
    nvlink_peers: tuple[int, ...] = ()
    # Same string on every GPU of one NVLink-connected group; a GPU without NVLink has its own.
    nvlink_domain: str
    mig_capable: bool
    mig_mode: MigMode | None = None
    health: HealthState = HealthState.HEALTHY


class MigPlacement(_Frozen):
    """Location of a GPU instance: ``size`` memory slices starting at slice ``start``."""

    start: int = Field(ge=0)
    size: int = Field(ge=1)

    @property
    def end(self) -> int:
        """One past the last memory slice used."""
        return self.start + self.size

    def overlaps(self, other: MigPlacement) -> bool:
        return self.start < other.end and other.start < self.end


class MigEngines(_Frozen):
    """Engines dedicated to one GPU instance of a profile."""

    copy_engines: int = Field(ge=0)
    decoders: int = Field(ge=0)
    encoders: int = Field(ge=0)
    jpeg_decoders: int = Field(ge=0)
    ofa: int = Field(ge=0)


class MigProfile(_Frozen):
    """A GPU instance profile as the GPU reports it, with every placement it allows."""

    name: str  # e.g. "1g.10gb", "1g.10gb+me"
    profile_id: int = Field(ge=0)  # the NVML profile *id* every MIG call takes, not the enum
    compute_slices: int = Field(ge=1)
    memory_slices: int = Field(ge=1)
    memory_mib: int = Field(ge=1)
    multiprocessors: int = Field(ge=1)
    engines: MigEngines
    max_instances: int = Field(ge=1)
    placements: tuple[MigPlacement, ...]


class MigDevice(_Frozen):
    """An existing GPU instance and its compute instance on a parent GPU.

    ``uuid`` and ``compute_instance_id`` are ``None`` for a GPU instance left without a compute
    instance (a half-finished create), which is invisible to CUDA and only good for cleanup.
    """

    parent_index: int = Field(ge=0)
    parent_uuid: str
    profile_id: int
    profile_name: str
    placement: MigPlacement
    gpu_instance_id: int = Field(ge=0)
    compute_instance_id: int | None = None
    uuid: str | None = None


class MpsDaemon(_Frozen):
    """An MPS control daemon serving one GPU. Clients reach it through ``pipe_dir``."""

    gpu_index: int = Field(ge=0)
    gpu_uuid: str
    pipe_dir: str
    log_dir: str
    # Bound over /dev/shm for the daemon and its clients: MPS talks through shared memory,
    # and a folder of its own keeps clients away from the host's /dev/shm.
    shm_dir: str


class HealthEventKind(StrEnum):
    XID = "Xid"
    GPU_LOST = "GpuLost"


class HealthEvent(_Frozen):
    kind: HealthEventKind
    gpu_index: int
    gpu_uuid: str
    xid: int | None = None
    # Set when NVML attributes the event to one MIG instance.
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class ProcessSample(_Frozen):
    """One process running on a GPU: memory it holds and, when sampled, its utilisation."""

    pid: int
    used_memory_mib: int | None = None
    sm_utilization_percent: int | None = None
    memory_utilization_percent: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
