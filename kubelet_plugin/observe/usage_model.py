"""What the usage sampler reports: per claim device, per GPU, per claim (running totals),
and the settings it samples with. Data only; usage.py fills it, usage_metrics.py exports it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexgpu.driver.claim_consumers import consumers


@dataclass(frozen=True)
class UsageSettings:
    interval_s: float = 15.0
    idle_threshold: float = 0.05  # SM utilisation, 0-1
    idle_window_s: float = 7200.0
    proc_root: Path = Path("/proc")


@dataclass(frozen=True)
class PodRef:
    name: str
    uid: str


@dataclass(frozen=True)
class ClaimInfo:
    """What the claim object says beyond the checkpoint: its pods and request classes."""

    pods: tuple[PodRef, ...] = ()
    classes: Mapping[str, str] = field(default_factory=dict)  # request name -> device class
    # Consumers that are not pods, as people read them: a gang's claim is reserved for its
    # PodGroup ("podgroups.scheduling.k8s.io/<name>") and names none of the member pods.
    groups: tuple[str, ...] = ()

    @property
    def users(self) -> tuple[str, ...]:
        """The `pods` label: pod names, then the other consumers."""
        return (*sorted(p.name for p in self.pods), *self.groups)


def claim_info(obj: Mapping[str, Any] | None) -> ClaimInfo:
    if not obj:
        return ClaimInfo()
    reserved = consumers(obj.get("status"))
    pods = tuple(PodRef(c.name, c.uid) for c in reserved if c.is_pod)
    groups = tuple(c.label for c in reserved if not c.is_pod)
    classes: dict[str, str] = {}
    for request in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = str(request.get("name", ""))
        exactly = request.get("exactly") or {}
        if exactly.get("deviceClassName"):
            classes[name] = str(exactly["deviceClassName"])
        for sub in request.get("firstAvailable") or []:
            if sub.get("deviceClassName"):
                classes[f"{name}/{sub.get('name', '')}"] = str(sub["deviceClassName"])
    return ClaimInfo(pods=pods, classes=classes, groups=groups)


@dataclass(frozen=True)
class DeviceUsage:
    """One device of one prepared claim."""

    namespace: str
    claim: str
    uid: str
    device: str
    gpu_index: int
    kind: str  # gpu, mig or shared
    device_class: str
    product: str
    profile: str
    share: str
    pods: tuple[str, ...]  # ClaimInfo.users: pod names, then e.g. a PodGroup
    allocated_gpus: float  # the part of a GPU the device is
    sm_utilization: (
        float | None
    )  # 0-1: of the device (whole GPU, MIG instance); a share: of the GPU
    memory_used_bytes: int | None
    processes: int | None

    @property
    def used_gpus(self) -> float | None:
        """Busy GPUs: a MIG instance's utilisation counts for its part of the GPU only."""
        if self.sm_utilization is None:
            return None
        if self.kind == "mig":
            return self.sm_utilization * self.allocated_gpus
        return self.sm_utilization


@dataclass(frozen=True)
class GpuRow:
    index: int
    device: str
    product: str
    sm_utilization: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int
    processes: int
    claims: tuple[str, ...]  # namespace/name of every claim holding (part of) it


@dataclass
class ClaimTotals:
    namespace: str
    claim: str
    allocated_gpu_seconds: dict[str, float] = field(default_factory=dict)  # by device
    used_gpu_seconds: dict[str, float] = field(default_factory=dict)
    idle_since: float | None = None


@dataclass(frozen=True)
class UsageSnapshot:
    node: str
    gpus: tuple[GpuRow, ...] = ()
    devices: tuple[DeviceUsage, ...] = ()
    idle_seconds: Mapping[str, float | None] = field(default_factory=dict)  # uid -> s or None
    mps_daemons: int | None = None
