"""Turns the backend's health events into device health for the kubelet and the slices.

Each event is classified (driver/xid.py) and kept in a ledger per GPU (driver/device_health.py):
an application fault changes nothing, an informational one (a recorded ECC row remap) taints
the GPU's devices with effect ``None``, a fatal one (a double-bit ECC error, a lost GPU, NVML
gone) with ``NoSchedule``, so nothing new is scheduled there. Where the cluster has no device
taints, a fatal fault withdraws the GPU's devices instead (node_devices.py). A fault is cleared
once none of its class has been seen for the healthy period; a lost GPU and an unreachable
NVML count as seen for as long as they last. Claims already prepared on a faulty GPU stay
prepared; the kubelet's health stream reports their devices unhealthy, so pod status shows it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.device_health import (
    DEFAULT_HEALTHY_PERIOD_S,
    HealthLedger,
    Scope,
    fault_for_event,
    nvml_unavailable,
)
from flexgpu.driver.gpu_model import HealthEvent
from flexgpu.driver.xid import FaultClass
from flexgpu.kubelet_plugin.api.node_events import NodeEventSink
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import DeviceHealth, HealthStatus

log = logging.getLogger(__name__)

# Event waits failing this many times in a row mean NVML itself is gone, not a hiccup.
NVML_FAILURES_BEFORE_FAULT = 3
# How often a GPU with a fault is checked for recovery (is a lost GPU back? period over?).
RECOVERY_CHECK_S = 5.0


class HealthMonitor:
    """Implements the gRPC service's HealthSource."""

    def __init__(
        self,
        backend: GpuBackend,
        devices: NodeDevices,
        pool_name: str,
        on_change: Callable[[], None] | None = None,
        *,
        healthy_period_s: float = DEFAULT_HEALTHY_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        events: NodeEventSink | None = None,
    ) -> None:
        # A Warning Event on the Node per new fault: on releases without taints it is where
        # admins see a withdrawn GPU.
        self._events = events
        self._backend = backend
        self._devices = devices
        self._pool = pool_name
        self._on_change = on_change
        self._clock = clock
        self._lock = threading.Lock()
        self._ledger = HealthLedger(healthy_period_s)
        self._ignored_xids: frozenset[int] = frozenset()
        self._listeners: list[Callable[[], None]] = []
        self._failures = 0
        self._last_check = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- HealthSource ----------------------------------------------------------------------
    def snapshot(self) -> Sequence[DeviceHealth]:
        now = int(time.time())
        return [
            DeviceHealth(
                pool_name=self._pool,
                device_name=name,
                status=HealthStatus.HEALTHY if healthy else HealthStatus.UNHEALTHY,
                last_updated=now,
                message=why,
            )
            for name, healthy, why in self._devices.device_health()
        ]

    def subscribe(self, on_change: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(on_change)

        def unsubscribe() -> None:
            with self._lock:
                if on_change in self._listeners:
                    self._listeners.remove(on_change)

        return unsubscribe

    def set_ignored_xids(self, xids: frozenset[int]) -> None:
        """Xids the node's GpuNodePolicy says to ignore (``spec.health.ignoredXids``)."""
        with self._lock:
            self._ignored_xids = xids

    # -- event loop --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)

    def handle(self, event: HealthEvent) -> None:
        with self._lock:
            fault = fault_for_event(event, self._clock(), self._ignored_xids)
            if fault is None:
                log.info(
                    "GPU %d: Xid %s is an application fault or ignored; GPU stays healthy",
                    event.gpu_index,
                    event.xid,
                )
                return
            scope = self._scope(event, fault.fault)
            changed = self._ledger.record(scope, fault)
        if changed:
            log.warning(
                "GPU %d (%s): %s; its devices are tainted %s=%s:%s",
                event.gpu_index,
                event.gpu_uuid,
                fault.message,
                fault.taint()["key"],
                fault.value,
                fault.impact.value,
            )
            self._publish()
            self._event(
                "GpuFault",
                f"GPU {event.gpu_index} ({event.gpu_uuid})"
                + (f", MIG device {scope[1]}" if scope[1] else "")
                + f": {fault.message}; "
                + self._consequence(fault.fatal, f"{fault.taint()['key']}={fault.value}"),
            )

    def _scope(self, event: HealthEvent, fault: FaultClass) -> Scope:
        """One MIG device when NVML names the GPU instance the Xid came from and flexgpu
        publishes that instance (as NVIDIA's device plugin does); else the whole GPU."""
        if event.gpu_instance_id is None or fault in (FaultClass.GPU_LOST, FaultClass.NVML):
            return (event.gpu_index, None)
        device = self._devices.device_on_instance(event.gpu_index, event.gpu_instance_id)
        return (event.gpu_index, device)

    def _consequence(self, fatal: bool, taint: str) -> str:
        if self._devices.health_taints:
            effect = "NoSchedule" if fatal else "None"
            return f"its devices are tainted {taint}:{effect}"
        return "it is withdrawn from the ResourceSlices" if fatal else "it stays in service"

    def _event(self, reason: str, message: str) -> None:
        if self._events is not None:
            self._events(reason, message)

    def nvml_failed(self, why: str) -> None:
        """An NVML call failed; after a few in a row every GPU gets the NVML fault."""
        with self._lock:
            self._failures += 1
            if self._failures < NVML_FAILURES_BEFORE_FAULT:
                return
            now = self._clock()
            changed = False
            for gpu in self._devices.gpus():
                changed |= self._ledger.record((gpu.index, None), nvml_unavailable(now, why))
        if changed:
            log.error("NVML unavailable (%s): new work is kept off every GPU until it answers", why)
            self._publish()
            self._event("GpuFault", f"NVML unavailable ({why}); new work is kept off every GPU")

    def nvml_answered(self) -> None:
        with self._lock:
            self._failures = 0

    def check_recovery(self) -> None:
        """Keeps lasting faults seen and clears those past the healthy period."""
        with self._lock:
            lost = self._ledger.with_fault(FaultClass.GPU_LOST)
            nvml = self._ledger.with_fault(FaultClass.NVML)
            if not self._ledger.faults():
                return
        present: set[int] | None = None
        if lost:
            try:
                present = {g.index for g in self._backend.list_gpus()}
            except Exception as err:  # an unreadable GPU list: nothing is back yet
                log.debug("GPU list failed during the recovery check: %s", err)
        with self._lock:
            now = self._clock()
            self._ledger.still_seen(lost - (present or set()), FaultClass.GPU_LOST, now)
            if self._failures >= NVML_FAILURES_BEFORE_FAULT:
                self._ledger.still_seen(nvml, FaultClass.NVML, now)
            cleared = self._ledger.expire(now)
        for (index, _), fault in cleared:
            log.info(
                "GPU %d: no %s for %.0fs; taint %s cleared",
                index,
                fault.fault.value,
                self._ledger.healthy_period_s,
                fault.taint()["key"],
            )
        if cleared:
            self._publish()
        for (index, _), fault in cleared:
            self._event(
                "GpuFaultCleared",
                f"GPU {index}: no {fault.fault.value} for {self._ledger.healthy_period_s:.0f}s; "
                f"{fault.taint()['key']} cleared",
            )

    def _publish(self) -> None:
        with self._lock:
            faults = self._ledger.faults()
            listeners = list(self._listeners)
        self._devices.set_health(faults)
        for listener in listeners:
            listener()
        if self._on_change:
            self._on_change()

    def _run(self) -> None:
        backoff = Backoff(1.0, 30.0)
        while not self._stop.is_set():
            if self._clock() - self._last_check >= RECOVERY_CHECK_S:
                self._last_check = self._clock()
                self._guarded(self.check_recovery)
            try:
                event = self._backend.wait_health_event(timeout_s=1.0)
            except Exception as err:  # the backend never kills the monitor
                self._guarded(partial(self.nvml_failed, str(err) or type(err).__name__))
                delay = backoff.next()
                log.warning("health event wait failed, retrying in %.1fs: %s", delay, err)
                self._stop.wait(delay)
                continue
            backoff.reset()
            self.nvml_answered()
            if event is not None:
                self._guarded(partial(self.handle, event))

    @staticmethod
    def _guarded(step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:  # a failed republish must not end health monitoring
            log.exception("health monitor step failed")
