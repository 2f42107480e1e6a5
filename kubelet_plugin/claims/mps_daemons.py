"""Who runs MPS control daemons: what prepare, unprepare and start-up reconcile ask of them.

Two kinds: a whole GPU's daemon, shared by every claim on the GPU (``start``/``stop`` by GPU
index), and the daemon of one claim's MIG devices (``start_mig``/``stop_mig``, keyed by the
first device's UUID; see ``driver.mps_daemon_spec``). ``BackendMpsDaemons`` lets the GPU
backend run them (the simulated backend records them; the NVML backend starts them beside the
plugin). ``kubelet_plugin.agents.mps_pods.MpsDaemonPods`` runs each as a pod of its own, which
outlives plugin restarts and upgrades.
"""

from __future__ import annotations

from typing import Protocol

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.gpu_model import MpsDaemon
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec


class MpsDaemons(Protocol):
    def start(self, index: int) -> MpsDaemon:
        """The GPU's daemon, started if none runs (a running one is adopted)."""

    def stop(self, index: int) -> None:
        """Stops the GPU's daemon; no-op if none runs."""

    def start_mig(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        """The daemon of a claim's MIG devices, started if none runs under ``spec.key``."""

    def stop_mig(self, parent_index: int, uuid: str) -> None:
        """Stops the MIG device daemon keyed by ``uuid``; no-op if none runs."""

    def running(self) -> list[MpsDaemon]:
        """The daemons running on this node, of whole GPUs and of MIG devices."""


class BackendMpsDaemons:
    def __init__(self, backend: GpuBackend) -> None:
        self._backend = backend

    def start(self, index: int) -> MpsDaemon:
        return self._backend.start_mps_daemon(index)

    def stop(self, index: int) -> None:
        self._backend.stop_mps_daemon(index)

    def start_mig(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        return self._backend.start_mig_mps_daemon(spec)

    def stop_mig(self, parent_index: int, uuid: str) -> None:
        self._backend.stop_mig_mps_daemon(parent_index, uuid)

    def running(self) -> list[MpsDaemon]:
        return self._backend.mps_daemons()
