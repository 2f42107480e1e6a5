"""Who runs a GPU's MPS control daemon: what prepare, unprepare and start-up reconcile ask of it.

``BackendMpsDaemons`` lets the GPU backend run it (the simulated backend records it; the NVML
backend starts it beside the plugin). ``kubelet_plugin.mps_pods.MpsDaemonPods`` runs it as a
pod of its own, which outlives plugin restarts and upgrades.
"""

from __future__ import annotations

from typing import Protocol

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.gpu_model import MpsDaemon


class MpsDaemons(Protocol):
    def start(self, index: int) -> MpsDaemon:
        """The GPU's daemon, started if none runs (a running one is adopted)."""

    def stop(self, index: int) -> None:
        """Stops the GPU's daemon; no-op if none runs."""

    def running(self) -> list[MpsDaemon]:
        """The daemons running on this node's GPUs."""


class BackendMpsDaemons:
    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend

    def start(self, index: int) -> MpsDaemon:
        return self._backend.start_mps_daemon(index)

    def stop(self, index: int) -> None:
        self._backend.stop_mps_daemon(index)

    def running(self) -> list[MpsDaemon]:
        return self._backend.mps_daemons()
