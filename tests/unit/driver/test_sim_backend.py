import json
import threading
from pathlib import Path

import pytest

from flexgpu.driver import sim_backend
from flexgpu.driver.backend_errors import (
    GpuBackendError,
    GpuLostError,
    InsufficientResourcesError,
    InUseError,
    NotFoundError,
    NotSupportedError,
)
from flexgpu.driver.gpu_model import (
    ComputeMode,
    HealthEventKind,
    HealthState,
    MigPlacement,
    ProcessSample,
    TimeSliceInterval,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sim_state import SimulatedStateError


def _at(start: int, size: int) -> MigPlacement:
    return MigPlacement(start=start, size=size)


@pytest.fixture
def hgx(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("hgx-h100-8", "node-a", tmp_path / "gpus.json")


def test_enumeration_matches_topology(hgx: SimulatedBackend) -> None:
    gpus = hgx.list_gpus()
    assert [g.index for g in gpus] == list(range(8))
    first = gpus[0]
    assert first.product_name == "NVIDIA H100 80GB HBM3"
    assert first.architecture == "Hopper" and first.cuda_compute_capability == "9.0"
    assert first.memory_mib == 81559 and first.multiprocessors == 132
    assert first.pci_bus_id == "0000:1b:00.0" and first.pcie_root == "pci0000:15"
    assert first.numa_node == 0 and gpus[7].numa_node == 1
    assert first.driver_version == "580.95.05" and first.cuda_driver_version == "13.0"
    assert len({g.nvlink_domain for g in gpus}) == 1
    assert first.nvlink_peers == (1, 2, 3, 4, 5, 6, 7)
    assert first.uuid.startswith("GPU-") and len(first.uuid) == 40
    assert len({g.uuid for g in gpus}) == 8
    assert [g.mig_mode.current if g.mig_mode else None for g in gpus] == [False] * 6 + [True] * 2


def test_uuids_are_deterministic_per_node(tmp_path: Path) -> None:
    a1 = SimulatedBackend.from_topology("l4-2-pcie", "node-a").list_gpus()
    a2 = SimulatedBackend.from_topology("l4-2-pcie", "node-a").list_gpus()
    b = SimulatedBackend.from_topology("l4-2-pcie", "node-b").list_gpus()
    assert [g.uuid for g in a1] == [g.uuid for g in a2]
    assert not {g.uuid for g in a1} & {g.uuid for g in b}
    # PCIe-only GPUs each get a domain of their own.
    assert a1[0].nvlink_domain != a1[1].nvlink_domain
    assert a1[0].nvlink_peers == ()


def test_h200_full_mesh_is_one_domain() -> None:
    gpus = SimulatedBackend.from_topology("h200-4", "n").list_gpus()
    assert len({g.nvlink_domain for g in gpus}) == 1
    assert gpus[2].nvlink_peers == (0, 1, 3)


def test_mig_lifecycle_and_rules(hgx: SimulatedBackend) -> None:
    device = hgx.create_mig_device(6, 9, _at(0, 4))  # 3g.40gb
    assert device.profile_name == "3g.40gb" and device.uuid and device.uuid.startswith("MIG-")
    assert device.parent_uuid == hgx.list_gpus()[6].uuid
    with pytest.raises(InsufficientResourcesError, match="overlaps"):
        hgx.create_mig_device(6, 19, _at(3, 1))
    hgx.create_mig_device(6, 9, _at(4, 4))
    with pytest.raises(InsufficientResourcesError, match="at most 2"):
        hgx.create_mig_device(6, 9, _at(4, 4))
    with pytest.raises(InUseError):
        hgx.set_mig_mode(6, False)
    assert [d.placement.start for d in hgx.list_mig_devices(6)] == [0, 4]
    hgx.destroy_mig_device(6, device.gpu_instance_id)
    with pytest.raises(NotFoundError):
        hgx.destroy_mig_device(6, device.gpu_instance_id)
    again = hgx.create_mig_device(6, 9, _at(0, 4))
    assert again.uuid != device.uuid  # re-created instances get new UUIDs, as on hardware


def test_mig_refused_when_disabled_or_unsupported(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_topology("mixed", "n", tmp_path / "s.json")
    with pytest.raises(NotSupportedError):
        backend.create_mig_device(0, 19, _at(0, 1))  # T4
    with pytest.raises(NotSupportedError):
        backend.mig_profiles(0)
    assert backend.list_mig_devices(0) == []
    backend.set_mig_mode(1, False)
    with pytest.raises(NotSupportedError, match="disabled"):
        backend.create_mig_device(1, 19, _at(0, 1))
    assert backend.set_mig_mode(1, True).current is True
    backend.create_mig_device(1, 19, _at(0, 1))


def test_compute_slices_are_capped() -> None:
    backend = SimulatedBackend.from_topology("mixed", "n")
    # 4g at 0 plus 2g at 4 use six compute slices; 1g.20gb at 6 takes the seventh.
    backend.create_mig_device(1, 5, _at(0, 4))
    backend.create_mig_device(1, 14, _at(4, 2))
    backend.create_mig_device(1, 15, _at(6, 2))
    assert len(backend.list_mig_devices(1)) == 3


def test_state_survives_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    first = SimulatedBackend.from_topology("h200-4", "n", path)
    created = first.create_mig_device(2, 14, _at(2, 2))
    first.set_compute_mode(1, ComputeMode.EXCLUSIVE_PROCESS)
    first.set_time_slice(3, TimeSliceInterval.LONG)
    first.set_mig_mode(0, False)
    second = SimulatedBackend.from_topology("h200-4", "n", path)
    assert second.list_mig_devices(2) == [created]
    assert second.get_compute_mode(1) == ComputeMode.EXCLUSIVE_PROCESS
    assert second.time_slice(3) == TimeSliceInterval.LONG
    assert second.get_mig_mode(0).current is False
    assert json.loads(path.read_text())["node_name"] == "n"


def test_state_of_another_node_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    SimulatedBackend.from_topology("h200-4", "node-a", path)
    with pytest.raises(SimulatedStateError, match="node-a"):
        SimulatedBackend.from_topology("h200-4", "node-b", path)
    path.write_text("{not json")
    with pytest.raises(SimulatedStateError, match="not a valid"):
        SimulatedBackend.from_topology("h200-4", "node-a", path)


def test_many_nodes_in_one_process(tmp_path: Path) -> None:
    nodes = [
        SimulatedBackend.from_topology("mixed", f"node-{i}", tmp_path / f"{i}.json")
        for i in range(3)
    ]
    for node in nodes:
        node.create_mig_device(1, 0, _at(0, 8))
    uuids = {node.list_mig_devices(1)[0].uuid for node in nodes}
    assert len(uuids) == 3


def test_concurrent_creates_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two creates of the same placement, the first held between its fit check and its write
    for as long as it takes the second to arrive: under the backend's lock the second cannot
    arrive (the wait gives up), so exactly one instance is created. Without the lock both
    would pass the check and write overlapping instances."""
    backend = SimulatedBackend.from_topology("mixed", "n")
    inside = threading.Barrier(2, timeout=0.5)
    met: list[bool] = []
    real = sim_backend.gpu_instance_id_for

    def between_check_and_write(placement: MigPlacement) -> int:
        try:
            inside.wait()
            met.append(True)
        except threading.BrokenBarrierError:
            met.append(False)
        return real(placement)

    monkeypatch.setattr(sim_backend, "gpu_instance_id_for", between_check_and_write)
    errors: list[Exception] = []

    def create() -> None:
        try:
            backend.create_mig_device(1, 14, _at(0, 2))
        except InsufficientResourcesError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert met == [False], "two creates were between fit check and write at once"
    assert [d.placement.start for d in backend.list_mig_devices(1)] == [0]
    assert len(errors) == 1


def test_fault_injection_fails_next_calls(hgx: SimulatedBackend) -> None:
    hgx.faults.fail_next("create_mig_device", count=2, error=InsufficientResourcesError)
    for _ in range(2):
        with pytest.raises(InsufficientResourcesError, match="create_mig_device"):
            hgx.create_mig_device(6, 19, _at(0, 1))
    hgx.create_mig_device(6, 19, _at(0, 1))
    hgx.faults.fail_next("list_gpus")
    with pytest.raises(GpuBackendError, match="injected failure in list_gpus"):
        hgx.list_gpus()
    with pytest.raises(ValueError, match=r"allowed values: .*create_mig_device"):
        hgx.faults.fail_next("explode")


def test_xid_events_and_health(hgx: SimulatedBackend) -> None:
    assert hgx.wait_health_event(0.01) is None
    hgx.inject_xid(3, 13)  # application error: GPU stays healthy
    hgx.inject_xid(4, 79)  # fell off the bus
    first = hgx.wait_health_event(1)
    second = hgx.wait_health_event(1)
    assert first is not None and first.kind == HealthEventKind.XID and first.xid == 13
    assert second is not None and second.gpu_index == 4
    health = {g.index: g.health for g in hgx.list_gpus()}
    assert health[3] == HealthState.HEALTHY and health[4] == HealthState.UNHEALTHY
    hgx.restore_gpu(4)
    assert hgx.list_gpus()[4].health == HealthState.HEALTHY


def test_wait_wakes_up_when_an_event_arrives(hgx: SimulatedBackend) -> None:
    timer = threading.Timer(0.05, hgx.inject_xid, args=(1, 48))
    timer.start()
    event = hgx.wait_health_event(5)
    timer.join()
    assert event is not None and event.xid == 48


def test_lost_gpu_disappears_and_persists(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    backend = SimulatedBackend.from_topology("hgx-h100-8", "n", path)
    backend.lose_gpu(2)
    event = backend.wait_health_event(1)
    assert event is not None and event.kind == HealthEventKind.GPU_LOST and event.gpu_index == 2
    assert 2 not in [g.index for g in backend.list_gpus()]
    with pytest.raises(GpuLostError):
        backend.get_compute_mode(2)
    restarted = SimulatedBackend.from_topology("hgx-h100-8", "n", path)
    assert len(restarted.list_gpus()) == 7
    restarted.restore_gpu(2)
    assert len(restarted.list_gpus()) == 8


def test_processes_block_destroy_and_mode_change(hgx: SimulatedBackend) -> None:
    device = hgx.create_mig_device(7, 19, _at(0, 1))
    hgx.set_processes(
        7, [ProcessSample(pid=42, used_memory_mib=100, gpu_instance_id=device.gpu_instance_id)]
    )
    with pytest.raises(InUseError):
        hgx.destroy_mig_device(7, device.gpu_instance_id)
    assert hgx.process_samples(7)[0].pid == 42
    hgx.set_processes(0, [ProcessSample(pid=7)])
    with pytest.raises(InUseError):
        hgx.set_mig_mode(0, True)
    hgx.set_processes(7, [])
    hgx.destroy_mig_device(7, device.gpu_instance_id)


def test_unknown_gpu_index(hgx: SimulatedBackend) -> None:
    with pytest.raises(NotFoundError):
        hgx.get_compute_mode(8)


def test_the_plugins_fault_setting_is_parsed_and_bad_entries_are_named() -> None:
    from flexgpu.driver.sim_faults import parse_fault_spec

    assert parse_fault_spec("create_mig_device:3, set_mig_mode") == [
        ("create_mig_device", 3),
        ("set_mig_mode", 1),
    ]
    assert parse_fault_spec("") == []
    with pytest.raises(ValueError, match=r"unknown operation 'explode'.*allowed values: "):
        parse_fault_spec("explode:2")
    with pytest.raises(ValueError, match=r"count of create_mig_device .* got '0'"):
        parse_fault_spec("create_mig_device:0")
