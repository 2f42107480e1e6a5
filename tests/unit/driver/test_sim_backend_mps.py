"""MPS daemons on the simulated backend: one per GPU, adopted after a restart, compute mode
exclusive while it runs; one per claim's MIG devices, which leaves the parent's compute mode
alone and holds its devices."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import pytest

from flexgpu.driver.backend_errors import InUseError, NotFoundError
from flexgpu.driver.gpu_model import ComputeMode
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
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


def test_a_mig_device_daemon_leaves_its_parent_alone_and_holds_its_devices(
    tmp_path: Path,
) -> None:
    """As on hardware: no compute mode on the parent (its other partitions are other
    claims'), and an instance an MPS daemon serves cannot be destroyed."""
    state = tmp_path / "state.json"
    backend = SimulatedBackend.from_topology("hgx-h100-8", "n", state_path=state)
    backend.set_mig_mode(0, True)
    (profile,) = [p for p in backend.mig_profiles(0) if p.name == "1g.10gb"]
    made = [backend.create_mig_device(0, profile.profile_id, p) for p in profile.placements[:3]]
    uuids = tuple(sorted(m.uuid or "" for m in made[:2]))
    spec = MigMpsDaemonSpec(0, uuids, active_thread_percentage=50, pinned_memory_mib=(512, None))

    daemon = backend.start_mig_mps_daemon(spec)

    assert (daemon.gpu_index, daemon.gpu_uuid) == (0, uuids[0])
    assert Path(daemon.pipe_dir).is_dir() and Path(daemon.pipe_dir).parent.name == uuids[0]
    assert backend.get_compute_mode(0) == ComputeMode.DEFAULT
    started = backend.mig_mps_daemon(uuids[0])
    assert started is not None and started.device_uuids == list(uuids)
    assert (started.active_thread_percentage, started.pinned_memory_mib) == (50, {uuids[0]: 512})
    by_uuid = {m.uuid: m for m in made}
    with pytest.raises(InUseError, match=f"in use by the MPS daemon of {uuids[0]}"):
        backend.destroy_mig_device(0, by_uuid[uuids[1]].gpu_instance_id)
    backend.destroy_mig_device(0, made[2].gpu_instance_id)  # not the daemon's: goes

    restarted = SimulatedBackend.from_topology("hgx-h100-8", "n", state_path=state)
    assert restarted.mps_daemons() == [daemon]
    assert restarted.start_mig_mps_daemon(spec) == daemon and restarted.mps_starts(0) == 1
    restarted.stop_mig_mps_daemon(0, uuids[0])
    restarted.stop_mig_mps_daemon(0, uuids[0])  # idempotent
    assert restarted.mps_daemons() == [] and restarted.mig_mps_daemon(uuids[0]) is None
    restarted.destroy_mig_device(0, by_uuid[uuids[1]].gpu_instance_id)
    with pytest.raises(NotFoundError, match="cannot start its MPS daemon"):
        restarted.start_mig_mps_daemon(MigMpsDaemonSpec(0, (uuids[1],)))
