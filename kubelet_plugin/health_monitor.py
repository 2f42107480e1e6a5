"""Turns the backend's health events into device health for the kubelet and the slices.

A GPU with a hardware Xid (not one caused by the application) or that fell off the bus is
reported Unhealthy to the kubelet's health stream and withdrawn from the published slices, so
nothing new is scheduled on it; claims already prepared on it stay prepared.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.gpu_model import HealthEvent, HealthEventKind, HealthState
from flexgpu.driver.names import gpu_device_name
from flexgpu.driver.xid import xid_marks_unhealthy
from flexgpu.kubelet_plugin.kubeletplugin import DeviceHealth, HealthStatus
from flexgpu.kubelet_plugin.node_devices import NodeDevices

log = logging.getLogger(__name__)


class HealthMonitor:
    """Implements the gRPC service's HealthSource."""

    def __init__(
        self,
        backend: GpuBackend,
        devices: NodeDevices,
        pool_name: str,
        on_unhealthy: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend
        self._devices = devices
        self._pool = pool_name
        self._on_unhealthy = on_unhealthy
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._messages: dict[str, str] = {}
        self._since = int(time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- HealthSource ----------------------------------------------------------------------
    def snapshot(self) -> Sequence[DeviceHealth]:
        with self._lock:
            messages = dict(self._messages)
        now = int(time.time())
        return [
            DeviceHealth(
                pool_name=self._pool,
                device_name=gpu_device_name(g.index),
                status=HealthStatus.HEALTHY
                if g.health == HealthState.HEALTHY
                else HealthStatus.UNHEALTHY,
                last_updated=now,
                message=messages.get(gpu_device_name(g.index), ""),
            )
            for g in sorted(self._devices.gpus(), key=lambda g: g.index)
        ]

    def subscribe(self, on_change: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(on_change)

        def unsubscribe() -> None:
            with self._lock:
                if on_change in self._listeners:
                    self._listeners.remove(on_change)

        return unsubscribe

    # -- event loop --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def handle(self, event: HealthEvent) -> None:
        if event.kind == HealthEventKind.XID and event.xid is not None:
            if not xid_marks_unhealthy(event.xid):
                log.info(
                    "GPU %d: Xid %d is an application fault; GPU stays healthy",
                    event.gpu_index,
                    event.xid,
                )
                return
            reason = f"Xid {event.xid}"
        else:
            reason = "GPU lost (fell off the bus)"
        if not self._devices.mark_unhealthy(event.gpu_index):
            return
        log.warning("GPU %d (%s) is unhealthy: %s", event.gpu_index, event.gpu_uuid, reason)
        with self._lock:
            self._messages[gpu_device_name(event.gpu_index)] = reason
            listeners = list(self._listeners)
        for listener in listeners:
            listener()
        if self._on_unhealthy:
            self._on_unhealthy()

    def _run(self) -> None:
        backoff = Backoff(1.0, 30.0)
        while not self._stop.is_set():
            try:
                event = self._backend.wait_health_event(timeout_s=1.0)
            except Exception as err:  # the backend never kills the monitor
                delay = backoff.next()
                log.warning("health event wait failed, retrying in %.1fs: %s", delay, err)
                self._stop.wait(delay)
                continue
            backoff.reset()
            if event is not None:
                self.handle(event)
