"""MPS daemons on the simulated backend: one per GPU, adopted after a restart, compute mode
exclusive while it runs."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest

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


def test_an_in_memory_node_makes_its_mps_folder_on_use_and_removes_it_with_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without a state file the backend's MPS folders live in a temporary root; tests build
    # many such backends, so none may be left behind once a backend is gone.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    backend = SimulatedBackend.from_topology("l4-2-pcie", "n")
    assert list(tmp_path.iterdir()) == []  # nothing made until a daemon needs it
    daemon = backend.start_mps_daemon(0)
    root = Path(daemon.pipe_dir).parents[1]
    assert root.parent == tmp_path and root.name.startswith("flexgpu-sim-mps-")
    assert Path(daemon.pipe_dir).is_dir()
    assert backend.mps_daemons() == [daemon]  # the same folders while the backend lives
    del backend
    gc.collect()
    assert not root.exists()
