"""Prepare waits a little for claims that still hold its devices but are on their way out.

The scheduler gives a device to a new claim as soon as the old claim is deallocated, and the
kubelet unprepares the old claim only once its pod's containers are gone: a pod deleted
without grace, or a finished Job pod whose claim the controller frees at once, leaves its
claim prepared on the node for a second or two after the device was allocated again. Refusing
the new claim then costs its pod the kubelet's retry backoff (about 13 s measured) for a
conflict that ends by itself. So prepare waits, outside the GPU locks, until one of the
holding claims is unprepared, then checks again; for at most ``HOLDER_WAIT_S`` per call, after
which the refusal goes to the kubelet as before. A holder that stays (a real conflict) costs
that wait once per kubelet retry.

Waiting occupies one of the plugin's gRPC workers, and the unprepare that ends the wait needs
another: at most ``HOLDER_WAITERS`` calls wait at once (fewer than the workers), the others are
refused at once as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

__all__ = ["HOLDER_WAITERS", "HOLDER_WAIT_S", "HolderWait"]

# Well under the kubelet's 45 s call timeout, and a few times what an unprepare that is
# already coming takes.
HOLDER_WAIT_S = 10.0
# The DRA server has 4 workers (kubeletplugin/server.py): two stay free for unprepares.
HOLDER_WAITERS = 2
POLL_S = 0.05


class HolderWait:
    def __init__(
        self,
        still_held: Callable[[str], bool],
        *,
        wait_s: float = HOLDER_WAIT_S,
        waiters: int = HOLDER_WAITERS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._still_held = still_held
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(waiters) if waiters > 0 else None
        self._clock = clock
        self._sleep = sleep
        self.waited = 0  # waits that ended with a holder gone, for tests and the log

    def deadline(self) -> float:
        return self._clock() + self.wait_s

    def until_one_leaves(self, holders: Iterable[str], deadline: float) -> bool:
        """Waits until one of ``holders`` (claim UIDs) is no longer held; False when none
        left before ``deadline``, when there is none to wait for, or when enough calls wait
        already."""
        uids = tuple(holders)
        if not uids or self._slots is None or self._clock() >= deadline:
            return False
        if not self._slots.acquire(blocking=False):
            return False
        try:
            while True:
                if not all(self._still_held(uid) for uid in uids):
                    self.waited += 1
                    return True
                if self._clock() >= deadline:
                    return False
                self._sleep(POLL_S)
        finally:
            self._slots.release()
