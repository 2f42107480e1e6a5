"""Stands in for the preparer and the health source while the plugin starts.

The sockets are served as soon as the process runs, before the GPUs are enumerated and the
checkpoint is reconciled; a prepare or unprepare that arrives meanwhile waits here until
start-up reconcile has finished (it must never run against a checkpoint still being rolled
back), and health streams opened early get the devices as soon as they are known.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence

from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    DeviceHealth,
    DraDriver,
    HealthSource,
    PrepareResult,
    UnprepareResult,
)

# Below the kubelet's own deadline for a DRA call, so the claim gets our reason, not a
# timeout; the kubelet retries.
WAIT_S = 30.0


class StartupGate:
    """Implements DraDriver and HealthSource by waiting for the real ones."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._wait_s = wait_s
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._preparer: DraDriver | None = None
        self._health: HealthSource | None = None
        self._failure: str | None = None
        # Health listeners that subscribed before the source existed, with their handle on
        # the real source once there is one.
        self._early: dict[int, tuple[Callable[[], None], Callable[[], None] | None]] = {}
        self._keys = itertools.count()

    # -- start-up --------------------------------------------------------------------------
    def open(self, preparer: DraDriver, health: HealthSource) -> None:
        with self._lock:
            self._preparer, self._health = preparer, health
            for key, (listener, _) in list(self._early.items()):
                self._early[key] = (listener, health.subscribe(listener))
            listeners = [listener for listener, _ in self._early.values()]
        self._ready.set()
        for listener in listeners:
            listener()  # early streams resend, now with the devices

    def fail(self, reason: str) -> None:
        with self._lock:
            self._failure = reason
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._preparer is not None

    # -- DraDriver ---------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        preparer, why = self._await()
        if preparer is None:
            return {c.uid: PrepareResult.failed(why) for c in claims}
        return preparer.prepare(claims)

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        preparer, why = self._await()
        if preparer is None:
            return {c.uid: UnprepareResult(error=why) for c in claims}
        return preparer.unprepare(claims)

    def _await(self) -> tuple[DraDriver | None, str]:
        if not self._ready.wait(self._wait_s):
            return None, (
                f"the plugin is still starting (GPU discovery and checkpoint reconcile have "
                f"not finished after {self._wait_s:.0f}s); retry"
            )
        with self._lock:
            if self._preparer is None:
                return None, f"the plugin failed to start: {self._failure}"
            return self._preparer, ""

    # -- HealthSource ----------------------------------------------------------------------
    def snapshot(self) -> Sequence[DeviceHealth]:
        with self._lock:
            health = self._health
        return [] if health is None else health.snapshot()

    def subscribe(self, on_change: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            if self._health is not None:
                return self._health.subscribe(on_change)
            key = next(self._keys)
            self._early[key] = (on_change, None)

        def unsubscribe() -> None:
            with self._lock:
                _, real = self._early.pop(key, (None, None))
            if real is not None:
                real()

        return unsubscribe
