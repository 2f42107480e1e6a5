"""The node's devices as the plugin publishes and prepares them: a cached inventory from the
backend, refreshed when health changes."""

from __future__ import annotations

import threading
from typing import Any

from driver.backend import GpuBackend
from driver.cdi import CdiDevice, host_device_nodes
from driver.gpu_model import GpuInfo, HealthState
from driver.names import gpu_device_name
from driver.resource_slice import Device, render_whole_gpus


class NodeDevices:
    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._gpus: dict[str, GpuInfo] = {}
        self._unhealthy: set[int] = set()
        self.refresh()

    def refresh(self) -> None:
        gpus = self._backend.list_gpus()
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

    def slice_devices(self) -> list[Device]:
        return render_whole_gpus(self.gpus())

    def resolve(self, device_name: str) -> CdiDevice | None:
        with self._lock:
            gpu = self._gpus.get(device_name)
        if gpu is None:
            return None
        return CdiDevice(device_name, gpu.uuid, host_device_nodes(gpu.minor_number))

    def describe(self) -> dict[str, Any]:
        return {name: g.uuid for name, g in self._gpus.items()}
