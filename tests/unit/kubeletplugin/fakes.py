"""In-memory DraDriver and HealthSource for tests of the kubeletplugin gRPC surface."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence

from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    DeviceHealth,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)


class MemoryPreparer:
    """Hands every claim one device named after it; remembers what is prepared."""

    def __init__(self) -> None:
        self.prepared: dict[str, ClaimRef] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.fail_with: Exception | None = None

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        self.calls.append(("prepare", [c.uid for c in claims]))
        if self.fail_with:
            raise self.fail_with
        results = {}
        for claim in claims:
            self.prepared[claim.uid] = claim
            device = PreparedDevice(
                pool_name="node-a",
                device_name=f"gpu-{claim.name}",
                cdi_device_ids=(f"k8s.gpu.flexgpu.dev/claim={claim.uid}",),
                request_names=("gpu",),
                share_id=f"share-{claim.uid}" if claim.name.startswith("shared") else None,
            )
            results[claim.uid] = PrepareResult(devices=(device,))
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        self.calls.append(("unprepare", [c.uid for c in claims]))
        if self.fail_with:
            raise self.fail_with
        for claim in claims:
            self.prepared.pop(claim.uid, None)
        return {c.uid: UnprepareResult() for c in claims}


class MemoryHealth:
    """A settable device list that notifies subscribers on every change."""

    def __init__(self, devices: Sequence[DeviceHealth] = ()) -> None:
        self._devices = list(devices)
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[], None]] = []

    def snapshot(self) -> Sequence[DeviceHealth]:
        with self._lock:
            return list(self._devices)

    def subscribe(self, on_change: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            self._subscribers.append(on_change)
        return lambda: self._unsubscribe(on_change)

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def set(self, devices: Sequence[DeviceHealth]) -> None:
        with self._lock:
            self._devices = list(devices)
            subscribers = list(self._subscribers)
        for notify in subscribers:
            notify()

    def _unsubscribe(self, on_change: Callable[[], None]) -> None:
        with self._lock:
            self._subscribers.remove(on_change)
