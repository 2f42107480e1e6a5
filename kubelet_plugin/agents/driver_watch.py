"""Polls the driver root and settles a driver change (claims/driver_change.py) on its own, so
that prepared claims' specs follow a new driver even when no prepare arrives: a restarted
container of a running pod reads its spec again. A refused prepare wakes it at once."""

from __future__ import annotations

from flexgpu.driver.loop import Loop
from flexgpu.kubelet_plugin.claims.driver_change import DriverChange

# A poll is a readlink and a stat; specs of running pods follow within this many seconds.
POLL_S = 2.0


class DriverWatch:
    def __init__(self, change: DriverChange, poll_s: float = POLL_S) -> None:
        self._loop = Loop("driver-watch", self._step, poll_s)
        change.wake = self._loop.poke
        self._change = change

    def _step(self) -> float | None:
        self._change.settle()
        return None

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()
