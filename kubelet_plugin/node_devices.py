"""The node's devices as the plugin publishes and prepares them: a cached inventory from the
backend, which GPUs are shared, refreshed when health changes."""

from __future__ import annotations

import threading
from collections.abc import Collection

from driver.backend import GpuBackend
from driver.cdi import CdiDevice, host_device_nodes
from driver.config_resolution import DeviceType
from driver.gpu_model import GpuInfo, HealthState
from driver.names import gpu_device_name
from driver.resource_slice import Device, render_node_gpus


class NodeDevices:
    def __init__(self, backend: GpuBackend, shared: Collection[int] = ()) -> None:
        self.backend = backend
        self._shared = frozenset(shared)
        self._lock = threading.Lock()
        self._gpus: dict[str, GpuInfo] = {}
        self._unhealthy: set[int] = set()
        self.refresh()

    def refresh(self) -> None:
        gpus = self.backend.list_gpus()
        with self._lock:
            self._gpus = {gpu_device_name(g.index): g for g in gpus}

    def mark_unhealthy(self, index: int) -> bool:
        """Returns True when this changed the GPU's state."""
        with self._lock:
            if index in self._unhealthy:
                return False
            self._unhealthy.add(index)
            return True

    def gpus(self) -> list[GpuInfo]:
        with self._lock:
            return [
                g.model_copy(update={"health": HealthState.UNHEALTHY})
                if g.index in self._unhealthy
                else g
                for g in self._gpus.values()
            ]

    def gpu(self, device_name: str) -> GpuInfo | None:
        with self._lock:
            return self._gpus.get(device_name)

    def gpus_by_index(self) -> dict[int, GpuInfo]:
        return {g.index: g for g in self.gpus()}

    def device_type(self, device_name: str) -> DeviceType:
        gpu = self.gpu(device_name)
        return "shared" if gpu is not None and gpu.index in self._shared else "gpu"

    def slice_devices(self) -> list[Device]:
        return render_node_gpus(self.gpus(), self._shared)

    def resolve(self, device_name: str) -> CdiDevice | None:
        gpu = self.gpu(device_name)
        if gpu is None:
            return None
        return CdiDevice(device_name, gpu.uuid, host_device_nodes(gpu.minor_number))
