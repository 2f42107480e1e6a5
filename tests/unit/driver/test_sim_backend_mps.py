"""MPS daemons on the simulated backend: one per GPU, adopted after a restart, compute mode
exclusive while it runs."""

from __future__ import annotations

from pathlib import Path

from flexgpu.driver.gpu_model import ComputeMode
from flexgpu.driver.sim_backend import SimulatedBackend


def test_daemon_lifecycle_survives_a_backend_restart(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    backend = SimulatedBackend.from_topology("l4-2-pcie", "n", state_path=state)
    daemon = backend.start_mps_daemon(1)
    assert Path(daemon.pipe_dir).is_dir() and Path(daemon.log_dir).is_dir()
    assert daemon.gpu_uuid == backend.list_gpus()[1].uuid
    assert backend.get_compute_mode(1) == ComputeMode.EXCLUSIVE_PROCESS
    assert backend.start_mps_daemon(1) == daemon  # already running: returned, not restarted

    restarted = SimulatedBackend.from_topology("l4-2-pcie", "n", state_path=state)
    assert restarted.mps_daemons() == [daemon]
    assert restarted.start_mps_daemon(1) == daemon
    assert restarted.mps_starts(1) == 1

    restarted.stop_mps_daemon(1)
    restarted.stop_mps_daemon(1)  # idempotent
    assert restarted.mps_daemons() == []
    assert restarted.get_compute_mode(1) == ComputeMode.DEFAULT
