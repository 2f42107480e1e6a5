"""The first stage of the claim pipeline, and the health source while the plugin starts.

The sockets are served as soon as the process runs, before the GPUs are enumerated and the
checkpoint is reconciled; a prepare or unprepare that arrives meanwhile waits here until
start-up reconcile has finished (it must never run against a checkpoint still being rolled
back), and health streams opened early get the devices as soon as they are known.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence

from flexgpu.kubelet_plugin.claims.pipeline import Call, R, Step
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, DeviceHealth, HealthSource

# Below the kubelet's own deadline for a DRA call, so the claim gets our reason, not a
# timeout; the kubelet retries.
WAIT_S = 30.0


class StartupGate:
    """A pipeline stage that holds each call until start-up has finished (or answers every
    claim with why it has not), and a HealthSource that waits for the real one."""

    name = "start-up gate"

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self._wait_s = wait_s
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._opened = False
        self._health: HealthSource | None = None
        self._failure: str | None = None
        # Health listeners that subscribed before the source existed, with their handle on
        # the real source once there is one.
        self._early: dict[int, tuple[Callable[[], None], Callable[[], None] | None]] = {}
        self._keys = itertools.count()

    # -- start-up --------------------------------------------------------------------------
    def open(self, health: HealthSource) -> None:
        """Start-up has finished: held calls go on (along the path completed before this)."""
        with self._lock:
            self._opened, self._health = True, health
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
        return self._ready.is_set() and self._opened

    # -- Stage -----------------------------------------------------------------------------
    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]:
        why = self._await()
        if why is not None:
            return {c.uid: call.failed(why) for c in claims}
        return next_step(claims)

    def _await(self) -> str | None:
        """None once start-up has finished; otherwise why the call cannot go on."""
        if not self._ready.wait(self._wait_s):
            return (
                f"the plugin is still starting (GPU discovery and checkpoint reconcile have "
                f"not finished after {self._wait_s:.0f}s); retry"
            )
        with self._lock:
            if not self._opened:
                return f"the plugin failed to start: {self._failure}"
            return None

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
