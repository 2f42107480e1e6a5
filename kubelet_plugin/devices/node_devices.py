"""The node's devices as the plugin publishes and prepares them: a cached inventory from the
backend and each GPU's mode (whole, shared, static MIG layout, dynamic MIG), refreshed when
health or modes change."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.cdi import CdiDevice
from flexgpu.driver.config_resolution import DeviceType
from flexgpu.driver.device_health import Fault, Scope, health_message, is_fatal
from flexgpu.driver.gpu_model import GpuInfo, HealthState, MigDevice, MigProfile
from flexgpu.driver.mig_devices import (
    MigPartition,
    counter_set,
    dynamic_mig_devices,
    static_mig_devices,
    with_binding_conditions,
)
from flexgpu.driver.names import PARTITION_FAILED_TAINT, gpu_device_name
from flexgpu.driver.node_policy import GpuMode
from flexgpu.driver.resource_slice import (
    SliceDevice,
    shared_gpu_device,
    whole_gpu_device,
    with_tenant,
)
from flexgpu.kubelet_plugin.devices.device_nodes import DeviceNodes

log = logging.getLogger(__name__)

TAINT_KEY = "flexgpu.dev/reconfiguring"


@dataclass
class _Rendered:
    """One GPU's devices as rendered from the backend, and what serving them needs."""

    devices: list[SliceDevice] = field(default_factory=list)
    counters: dict[str, Any] | None = None  # dynamic MIG: the GPU's shared counters
    partitions: dict[str, MigPartition] = field(default_factory=dict)
    static: dict[str, MigDevice] = field(default_factory=dict)
    kinds: dict[str, DeviceType] = field(default_factory=dict)


class NodeDevices:
    def __init__(
        self,
        backend: GpuBackend,
        shared: frozenset[int] | set[int] = frozenset(),
        dynamic_mig: frozenset[int] | set[int] = frozenset(),
        *,
        health_taints: bool = True,
        binding_conditions: bool = False,
        publish_tenants: bool = False,
    ) -> None:
        self.backend = backend
        # On-demand MIG partitions and free shared GPUs carry binding conditions (Kubernetes
        # 1.36+): the plugin creates partitions (early_partitions.py) and gives a free GPU to
        # one namespace (tenant_binding.py) before the pod is bound.
        self.binding_conditions = binding_conditions
        # Shared GPUs carry a `tenant` attribute (the namespace they serve, "" when free)
        # that admission's per-namespace selector matches (tenant_attribute.py); off when
        # namespaces may share GPUs, so nothing is republished for them.
        self.publish_tenants = publish_tenants
        self._tenants: dict[int, str] = {}
        # Faults as device taints (Kubernetes 1.36+, or the gate on); else a GPU with a fatal
        # fault is withdrawn from the slices.
        self.health_taints = health_taints
        # Where device nodes are found; main.py points it at the driver root.
        self.nodes = DeviceNodes()
        self._lock = threading.RLock()
        self._modes: dict[int, GpuMode] = {i: GpuMode.SHARED for i in shared}
        self._modes.update({i: GpuMode.DYNAMIC_MIG for i in dynamic_mig})
        self._gpus: dict[str, GpuInfo] = {}
        self._missing: set[int] = set()  # GPUs gone from the backend's list
        self._health: dict[Scope, list[Fault]] = {}
        self._rendered: dict[int, _Rendered] = {}
        self._devices: list[SliceDevice] = []
        self._counters: list[dict[str, Any]] = []
        self._partitions: dict[str, MigPartition] = {}  # dynamic: created on prepare
        self._static: dict[str, MigDevice] = {}  # static layout: exist already
        self._kinds: dict[str, DeviceType] = {}
        self._taints: dict[int, str] = {}
        # GPU index -> why creating a partition there failed: its partitions are tainted
        # (withdrawn without taints) so a pod sent back by the scheduler goes elsewhere.
        self._partition_failures: dict[int, str] = {}
        # Dynamic-MIG GPUs: whether MIG mode switches without a GPU reset (probed once), and
        # their MIG profiles (read while MIG mode is on; NVML lists none with it off).
        self._switchable: dict[int, bool] = {}
        self._profiles: dict[int, list[MigProfile]] = {}
        self.refresh()

    # -- state ---------------------------------------------------------------------------
    def set_modes(self, modes: Mapping[int, GpuMode]) -> None:
        with self._lock:
            self._modes = {i: m for i, m in modes.items() if m != GpuMode.WHOLE}
        self.refresh()

    def set_taints(self, taints: Mapping[int, str]) -> None:
        """GPU index -> why: its devices get a NoSchedule taint at the next refresh, so
        nothing new is allocated there while it waits to be reconfigured."""
        with self._lock:
            self._taints = dict(taints)

    def set_partition_failures(self, failures: Mapping[int, str]) -> None:
        """GPU index -> why creating a partition failed; applied at the next refresh."""
        with self._lock:
            self._partition_failures = dict(failures)

    def mode(self, index: int) -> GpuMode:
        with self._lock:
            return self._modes.get(index, GpuMode.WHOLE)

    def set_health(self, faults: Mapping[Scope, Sequence[Fault]]) -> None:
        """(GPU index, None or one MIG device's name) -> its current faults
        (health_monitor.py); republish afterwards."""
        with self._lock:
            self._health = {scope: list(f) for scope, f in faults.items() if f}
        self.refresh()

    def _faults_of(self, index: int, device_name: str) -> list[Fault]:
        """The GPU's faults and the device's own (an Xid NVML put on its GPU instance)."""
        return self._health.get((index, None), []) + self._health.get((index, device_name), [])

    def device_on_instance(self, index: int, gpu_instance_id: int) -> str | None:
        """The published MIG device that GPU instance of the GPU backs, if any."""
        with self._lock:
            for name, instance in self._static.items():
                if (instance.parent_index, instance.gpu_instance_id) == (index, gpu_instance_id):
                    return name
            partitions = {
                (p.profile_id, p.placement.start): n
                for n, p in self._partitions.items()
                if p.parent_index == index
            }
        if not partitions:
            return None
        try:
            instances = self.backend.list_mig_devices(index)
        except (GpuBackendError, OSError):
            return None
        for instance in instances:
            if instance.gpu_instance_id == gpu_instance_id:
                return partitions.get((instance.profile_id, instance.placement.start))
        return None

    def refresh(self) -> None:
        """Re-reads the GPUs (and their MIG state) and recomputes what is published.

        A faulty GPU is published with its faults as device taints when the cluster has them
        (``health_taints``), so admins and the scheduler see why; else a GPU with a fatal
        fault is withdrawn, as on releases without taints. Either way its devices stay known
        to the kubelet's health stream, and claims prepared on it stay prepared."""
        gpus = {gpu_device_name(g.index): g for g in self.backend.list_gpus()}
        with self._lock:
            # A GPU that fell off the bus leaves the backend's list; keep reporting it, as
            # unhealthy, so the kubelet and admins see what happened to it.
            self._missing = {g.index for n, g in self._gpus.items() if n not in gpus}
            for name, gone in self._gpus.items():
                gpus.setdefault(name, gone)
            self._gpus = gpus
            devices: list[SliceDevice] = []
            # Published last: the scheduler fills devices first-fit in slice order, so a
            # whole-GPU claim takes an ordinary GPU before it carves up a dynamic-MIG one.
            dynamic: list[SliceDevice] = []
            counters: list[dict[str, Any]] = []
            partitions: dict[str, MigPartition] = {}
            static: dict[str, MigDevice] = {}
            kinds: dict[str, DeviceType] = {}
            for gpu in sorted(self._gpus.values(), key=lambda g: g.index):
                rendered = self._render_or_keep(gpu)
                if rendered is None:
                    continue
                lost = gpu.index in self._missing
                if lost and not self._health.get((gpu.index, None)):
                    continue  # withdrawn until the health monitor has recorded the loss
                reconfiguring = (
                    [{"key": TAINT_KEY, "value": self._taints[gpu.index], "effect": "NoSchedule"}]
                    if gpu.index in self._taints
                    else []
                )
                failed = self._partition_failed_taint(gpu.index)
                mine = []
                for device in rendered.devices:
                    own: list[dict[str, str]] = []
                    if device["name"] in rendered.partitions:
                        if failed is not None and not self.health_taints:
                            continue  # no taints to say so: withdrawn for the cool-down
                        device = self._with_binding(device)  # noqa: PLW2901
                        own = [failed] if failed is not None else []
                    faults = self._faults_of(gpu.index, device["name"])
                    if not self.health_taints:
                        # Without taints the API server would drop them (and the publisher
                        # keep rewriting a slice it can never match): withdraw instead.
                        if not (lost or is_fatal(faults)):
                            mine.append(
                                {**device, "taints": reconfiguring} if reconfiguring else device
                            )
                        continue
                    taints = [f.taint() for f in faults] + reconfiguring + own
                    mine.append({**device, "taints": taints} if taints else device)
                if rendered.counters is not None:
                    counters.append(rendered.counters)
                partitions.update(rendered.partitions)
                static.update(rendered.static)
                kinds.update(rendered.kinds)
                (dynamic if rendered.counters is not None else devices).extend(mine)
            self._devices, self._counters = devices + dynamic, counters
            self._partitions, self._static, self._kinds = partitions, static, kinds

    def _partition_failed_taint(self, index: int) -> dict[str, str] | None:
        why = self._partition_failures.get(index)
        if why is None:
            return None
        return {"key": PARTITION_FAILED_TAINT, "value": _taint_value(why), "effect": "NoSchedule"}

    def _with_binding(self, device: SliceDevice) -> SliceDevice:
        """A partition as published: with binding conditions when they are on."""
        return with_binding_conditions(device) if self.binding_conditions else device

    def _render_or_keep(self, gpu: GpuInfo) -> _Rendered | None:
        """The GPU's devices now, or as last rendered when it cannot be read (lost, or
        failing NVML calls), so its devices stay known while it is faulty."""
        if gpu.index not in self._missing:
            try:
                self._rendered[gpu.index] = self._render(gpu)
            except (GpuBackendError, OSError) as err:
                log.warning(
                    "GPU %d: cannot read its devices (%s); keeping the last", gpu.index, err
                )
        return self._rendered.get(gpu.index)

    def _render(self, gpu: GpuInfo) -> _Rendered:
        out = _Rendered()
        mode = self._modes.get(gpu.index, GpuMode.WHOLE)
        name = gpu_device_name(gpu.index)
        switchable = mode == GpuMode.DYNAMIC_MIG and self._probe_switch(gpu)
        if mode == GpuMode.DYNAMIC_MIG and (switchable or self._mig_ready(gpu)):
            profiles = self._dynamic_profiles(gpu.index)
            mine, parts = dynamic_mig_devices(gpu, profiles)
            if not switchable:
                # A whole GPU needs MIG mode off, which this GPU only reaches through a
                # reset: it serves partitions only (docs/admin.md).
                mine = [d for d in mine if d["name"] != name]
            else:
                out.kinds[name] = "gpu"
            out.devices = mine
            out.counters = counter_set(gpu, profiles)
            out.partitions = parts
            out.kinds.update({n: "mig" for n in parts})
        elif (mode == GpuMode.MIG and self._mig_ready(gpu)) or self._adopt_mig(gpu, mode):
            profiles = self.backend.mig_profiles(gpu.index)
            instances = self.backend.list_mig_devices(gpu.index)
            out.devices, parts = static_mig_devices(gpu, profiles, instances)
            by_placement = {(i.profile_id, i.placement.start): i for i in instances}
            for device_name, part in parts.items():
                out.static[device_name] = by_placement[(part.profile_id, part.placement.start)]
                out.kinds[device_name] = "mig"
        elif mode == GpuMode.SHARED:
            out.devices = [shared_gpu_device(gpu)]
            out.kinds[name] = "shared"
        else:
            out.devices = [whole_gpu_device(gpu)]
            out.kinds[name] = "gpu"
        return out

    def _adopt_mig(self, gpu: GpuInfo, mode: GpuMode) -> bool:
        """A GPU without a mode of its own that is already in MIG mode (mig-parted, the GPU
        operator, an admin) serves the MIG devices it has: a whole GPU in MIG mode cannot
        run CUDA work. Nothing on it is created or destroyed."""
        return mode == GpuMode.WHOLE and gpu.mig_mode is not None and gpu.mig_mode.current

    def _mig_ready(self, gpu: GpuInfo) -> bool:
        """MIG mode on, switching it on where that needs no reset; otherwise the GPU is
        published whole and left alone."""
        if not gpu.mig_capable:
            log.warning("GPU %d (%s) has no MIG; publishing it whole", gpu.index, gpu.product_name)
            return False
        if gpu.mig_mode is not None and gpu.mig_mode.current:
            return True
        try:
            mode = self.backend.set_mig_mode(gpu.index, True)
        except GpuBackendError as err:
            log.warning("GPU %d: cannot enable MIG mode (%s); publishing it whole", gpu.index, err)
            return False
        if not mode.current:
            log.warning("GPU %d: MIG mode is pending a GPU reset; publishing it whole", gpu.index)
        return mode.current

    def _dynamic_profiles(self, index: int) -> list[MigProfile]:
        if index not in self._profiles:
            self._profiles[index] = self.backend.mig_profiles(index)
        return self._profiles[index]

    def _probe_switch(self, gpu: GpuInfo) -> bool:
        """Whether the GPU switches MIG mode without a reset, found by switching it once while
        no instance exists; it is left with MIG mode off, ready for a whole-GPU claim."""
        known = self._switchable.get(gpu.index)
        if known is not None:
            return known
        if not gpu.mig_capable or gpu.mig_mode is None:
            return False
        index = gpu.index
        try:
            if self.backend.list_mig_devices(index):
                return False  # prepared partitions: probed once they are gone
            if not gpu.mig_mode.current and not self.backend.set_mig_mode(index, True).current:
                self.backend.set_mig_mode(index, False)  # withdraw the pending request
                self._switchable[index] = False
                return False
            self._profiles[index] = self.backend.mig_profiles(index)
            off = not self.backend.set_mig_mode(index, False).current
            if not off:
                self.backend.set_mig_mode(index, True)
        except (GpuBackendError, OSError) as err:
            log.warning("GPU %d: cannot switch MIG mode (%s); serving partitions only", index, err)
            return False
        self._switchable[index] = off
        log.info(
            "GPU %d: MIG mode %s",
            index,
            "switches without a reset: whole-GPU claims get the GPU, partitions switch it on"
            if off
            else "needs a reset to switch: it serves MIG partitions only",
        )
        return off

    def ready_for(self, device_name: str) -> None:
        """Puts a dynamic-MIG GPU in the MIG mode the device needs: off for the whole GPU, on
        for a partition. The caller holds the GPU's lock; the counters in the slice keep a
        whole-GPU claim and a partition from being allocated on one GPU at once."""
        with self._lock:
            part = self._partitions.get(device_name)
            gpu = self._gpus.get(device_name)
        index = part.parent_index if part is not None else gpu.index if gpu is not None else None
        if index is None or not self._switchable.get(index):
            return
        want = part is not None
        mode = self.backend.get_mig_mode(index)
        if mode.current == want:
            return
        mode = self.backend.set_mig_mode(index, want)
        if mode.current != want:
            self.backend.set_mig_mode(index, not want)
            raise GpuBackendError(
                f"GPU {index}: MIG mode {'on' if want else 'off'} is pending a GPU reset; "
                f"{device_name} cannot be prepared until the GPU is reset"
            )

    def _current_gpus(self) -> list[GpuInfo]:
        return [
            g.model_copy(update={"health": HealthState.UNHEALTHY})
            if g.index in self._missing or is_fatal(self._health.get((g.index, None), ()))
            else g.model_copy(update={"health": HealthState.HEALTHY})
            for g in self._gpus.values()
        ]

    def device_health(self) -> list[tuple[str, bool, str]]:
        """(device name, healthy, why not) for every device of every GPU, published or
        withdrawn, in GPU order: what the kubelet's health stream reports."""
        with self._lock:
            rows: list[tuple[str, bool, str]] = []
            for index in sorted(self._rendered):
                lost = index in self._missing
                for device in self._rendered[index].devices:
                    faults = self._faults_of(index, device["name"])
                    why = health_message(faults) or ("GPU lost (not reachable)" if lost else "")
                    rows.append((device["name"], not lost and not is_fatal(faults), why))
            return rows

    # -- queries -------------------------------------------------------------------------
    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            return self._current_gpus()

    def gpus_by_index(self) -> dict[int, GpuInfo]:
        return {g.index: g for g in self.gpus()}

    def gpu(self, device_name: str) -> GpuInfo | None:
        """The physical GPU behind a device name (the parent of a MIG device)."""
        with self._lock:
            part = self._partitions.get(device_name)
            if part is not None:
                return self.gpus_by_index().get(part.parent_index)
            instance = self._static.get(device_name)
            if instance is not None:
                return self.gpus_by_index().get(instance.parent_index)
            return self._gpus.get(device_name)

    def device_type(self, device_name: str) -> DeviceType:
        with self._lock:
            return self._kinds.get(device_name, "gpu")

    def partition(self, device_name: str) -> MigPartition | None:
        """Set for devices whose MIG instance prepare creates (dynamic MIG)."""
        with self._lock:
            return self._partitions.get(device_name)

    def attributes(self, device_name: str) -> dict[str, Any] | None:
        """The device's attributes as last rendered for its slice (also while it is withdrawn
        for a fault), without the tenant the slice adds; None for a device never published."""
        with self._lock:
            for rendered in self._rendered.values():
                for device in rendered.devices:
                    if device["name"] == device_name:
                        return dict(device.get("attributes") or {})
        return None

    def mig_profiles(self, index: int) -> list[MigProfile]:
        if index in self._profiles:
            return list(self._profiles[index])
        return self.backend.mig_profiles(index)

    def set_tenants(self, tenants: Mapping[int, str]) -> bool:
        """GPU index -> the namespace its sharing serves (absent: free). True when a
        published value changed, so the caller republishes only then."""
        with self._lock:
            before = self._tenant_values()
            self._tenants = {i: ns for i, ns in tenants.items() if ns}
            return self.publish_tenants and self._tenant_values() != before

    def shared_gpu_index(self, device_name: str) -> int | None:
        """The GPU index of a shared GPU's device (whose tenant is published); None for
        every other device."""
        with self._lock:
            if self._kinds.get(device_name) != "shared":
                return None
            gpu = self._gpus.get(device_name)
            return gpu.index if gpu is not None else None

    def tenant_binding(self) -> bool:
        """Whether free shared GPUs carry the tenant binding conditions."""
        with self._lock:
            shared = any(kind == "shared" for kind in self._kinds.values())
        return self.binding_conditions and self.publish_tenants and shared

    def _tenant_values(self) -> dict[str, str]:
        """Shared device name -> its published tenant ("" when free)."""
        return {
            name: self._tenants.get(gpu.index, "")
            for name, gpu in self._gpus.items()
            if self._kinds.get(name) == "shared"
        }

    def slice_devices(self) -> list[SliceDevice]:
        with self._lock:
            if not self.publish_tenants:
                return list(self._devices)
            values = self._tenant_values()
            return [
                with_tenant(
                    device, values[device["name"]], binding_conditions=self.binding_conditions
                )
                if device["name"] in values
                else device
                for device in self._devices
            ]

    def counter_sets(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._counters)

    def dynamic_gpus(self) -> set[int]:
        with self._lock:
            return {p.parent_index for p in self._partitions.values()}

    def resolve(self, device_name: str) -> CdiDevice | None:
        """CDI content of a device that exists without prepare creating it."""
        with self._lock:
            instance = self._static.get(device_name)
            gpu = self._gpus.get(device_name)
        if instance is not None and instance.uuid is not None:
            parent = self.gpus_by_index().get(instance.parent_index)
            minor = parent.minor_number if parent else None
            nodes = self.nodes.mig(minor, instance.gpu_instance_id, instance.compute_instance_id)
            return CdiDevice(device_name, instance.uuid, nodes)
        if gpu is None:
            return None
        return CdiDevice(device_name, gpu.uuid, self.nodes.gpu(gpu.minor_number))


def _taint_value(why: str) -> str:
    """A taint value is a label value: at most 63 characters of [A-Za-z0-9_.-]."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in why)
    return cleaned[:63].strip("-_.") or "failed"
