"""One set of expectations, run against the simulated backend and the NVML backend over the NVML
mock library holding the same hardware (an A100-SXM4-80GB with MIG enabled, and a T4)."""

from __future__ import annotations

import pytest
from conftest import Hardware

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import (
    GpuLostError,
    InsufficientResourcesError,
    InUseError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
)
from flexgpu.driver.gpu_model import ComputeMode, HealthEventKind, HealthState, MigPlacement

Contract = tuple[GpuBackend, Hardware]
A100, T4 = 0, 1


def _at(start: int, size: int) -> MigPlacement:
    return MigPlacement(start=start, size=size)


def test_enumeration(contract: Contract) -> None:
    backend, _ = contract
    a100, t4 = backend.list_gpus()
    assert (a100.index, t4.index) == (0, 1)
    assert a100.product_name == "NVIDIA A100-SXM4-80GB" and t4.product_name == "Tesla T4"
    assert a100.architecture == "Ampere" and t4.architecture == "Turing"
    assert (a100.cuda_compute_capability, t4.cuda_compute_capability) == ("8.0", "7.5")
    assert (a100.memory_mib, t4.memory_mib) == (81920, 15360)
    assert (a100.multiprocessors, t4.multiprocessors) == (108, 40)
    assert (a100.pci_bus_id, t4.pci_bus_id) == ("0000:07:00.0", "0000:3b:00.0")
    assert a100.driver_version == "580.95.05" and a100.cuda_driver_version == "13.0"
    assert a100.mig_capable and not t4.mig_capable
    assert a100.mig_mode is not None and a100.mig_mode.current and t4.mig_mode is None
    assert a100.nvlink_domain != t4.nvlink_domain and a100.nvlink_peers == ()
    assert a100.uuid.startswith("GPU-") and a100.health == HealthState.HEALTHY


def test_mig_profiles_match_the_published_table(contract: Contract) -> None:
    backend, _ = contract
    profiles = {p.profile_id: p for p in backend.mig_profiles(A100)}
    assert {pid: p.name for pid, p in profiles.items()} == {
        19: "1g.10gb",
        20: "1g.10gb+me",
        15: "1g.20gb",
        14: "2g.20gb",
        9: "3g.40gb",
        5: "4g.40gb",
        0: "7g.80gb",
    }
    assert profiles[9].memory_mib == 40192 and profiles[9].multiprocessors == 42
    assert profiles[9].compute_slices == 3 and profiles[9].memory_slices == 4
    assert profiles[20].engines.ofa == 1 and profiles[19].engines.ofa == 0
    assert profiles[0].engines.copy_engines == 7 and profiles[0].max_instances == 1
    assert backend.possible_placements(A100, 14) == [_at(0, 2), _at(2, 2), _at(4, 2)]
    assert backend.possible_placements(A100, 19) == [_at(s, 1) for s in range(7)]


def test_mig_queries_on_a_gpu_without_mig(contract: Contract) -> None:
    backend, _ = contract
    with pytest.raises(NotSupportedError):
        backend.get_mig_mode(T4)
    with pytest.raises(NotSupportedError):
        backend.mig_profiles(T4)
    with pytest.raises(NotSupportedError):
        backend.create_mig_device(T4, 19, _at(0, 1))
    with pytest.raises(NotSupportedError):
        backend.set_mig_mode(T4, True)
    assert backend.list_mig_devices(T4) == []


def test_create_list_destroy(contract: Contract) -> None:
    backend, _ = contract
    big = backend.create_mig_device(A100, 9, _at(4, 4))
    small = backend.create_mig_device(A100, 19, _at(0, 1))
    assert big.profile_name == "3g.40gb" and big.placement == _at(4, 4)
    assert big.uuid is not None and big.uuid.startswith("MIG-")
    assert small.uuid is not None and small.uuid != big.uuid
    assert big.parent_uuid == backend.list_gpus()[A100].uuid
    assert big.compute_instance_id == 0
    listed = backend.list_mig_devices(A100)
    assert sorted(listed, key=lambda d: d.placement.start) == [small, big]
    backend.destroy_mig_device(A100, big.gpu_instance_id)
    assert backend.list_mig_devices(A100) == [small]
    with pytest.raises(NotFoundError):
        backend.destroy_mig_device(A100, big.gpu_instance_id)


def test_overlap_is_refused(contract: Contract) -> None:
    backend, _ = contract
    backend.create_mig_device(A100, 14, _at(2, 2))
    with pytest.raises(InsufficientResourcesError):
        backend.create_mig_device(A100, 19, _at(3, 1))
    with pytest.raises(InsufficientResourcesError):
        backend.create_mig_device(A100, 0, _at(0, 8))
    backend.create_mig_device(A100, 19, _at(1, 1))


def test_instance_count_is_capped(contract: Contract) -> None:
    backend, _ = contract
    backend.create_mig_device(A100, 20, _at(0, 1))  # 1g.10gb+me: one per GPU
    with pytest.raises(InsufficientResourcesError):
        backend.create_mig_device(A100, 20, _at(3, 1))


def test_invalid_profile_or_placement(contract: Contract) -> None:
    backend, _ = contract
    with pytest.raises(InvalidArgumentError):
        backend.create_mig_device(A100, 14, _at(1, 2))  # 2g starts at even slices only
    with pytest.raises(InvalidArgumentError):
        backend.create_mig_device(A100, 42, _at(0, 1))


def test_mig_mode_rules(contract: Contract) -> None:
    backend, _ = contract
    device = backend.create_mig_device(A100, 5, _at(0, 4))
    with pytest.raises(InUseError):
        backend.set_mig_mode(A100, False)
    backend.destroy_mig_device(A100, device.gpu_instance_id)
    mode = backend.set_mig_mode(A100, False)
    assert not mode.current and not mode.pending
    with pytest.raises(NotSupportedError):
        backend.create_mig_device(A100, 19, _at(0, 1))
    assert backend.list_mig_devices(A100) == []
    assert backend.set_mig_mode(A100, True).current


def test_processes_block_destroy(contract: Contract) -> None:
    backend, hardware = contract
    device = backend.create_mig_device(A100, 14, _at(0, 2))
    hardware.run_process(A100, pid=4242, used_mib=512, gpu_instance_id=device.gpu_instance_id)
    samples = backend.process_samples(A100)
    assert [(s.pid, s.used_memory_mib, s.gpu_instance_id) for s in samples] == [
        (4242, 512, device.gpu_instance_id)
    ]
    with pytest.raises(InUseError):
        backend.destroy_mig_device(A100, device.gpu_instance_id)
    hardware.stop_processes(A100)
    backend.destroy_mig_device(A100, device.gpu_instance_id)
    assert backend.process_samples(A100) == []


def test_compute_mode(contract: Contract) -> None:
    backend, _ = contract
    assert backend.get_compute_mode(T4) == ComputeMode.DEFAULT
    backend.set_compute_mode(T4, ComputeMode.EXCLUSIVE_PROCESS)
    assert backend.get_compute_mode(T4) == ComputeMode.EXCLUSIVE_PROCESS


def test_xid_event(contract: Contract) -> None:
    backend, hardware = contract
    assert backend.wait_health_event(0.01) is None
    hardware.inject_xid(T4, 48)
    event = backend.wait_health_event(2)
    assert event is not None and event.kind == HealthEventKind.XID
    assert (event.gpu_index, event.xid) == (T4, 48)
    assert event.gpu_uuid == backend.list_gpus()[T4].uuid
    assert backend.list_gpus()[T4].health == HealthState.UNHEALTHY
    assert backend.list_gpus()[A100].health == HealthState.HEALTHY


def test_lost_gpu(contract: Contract) -> None:
    backend, hardware = contract
    t4_uuid = backend.list_gpus()[T4].uuid
    hardware.lose_gpu(T4)
    assert [g.index for g in backend.list_gpus()] == [A100]
    event = backend.wait_health_event(2)
    assert event is not None and event.kind == HealthEventKind.GPU_LOST
    assert (event.gpu_index, event.gpu_uuid) == (T4, t4_uuid)
    assert backend.wait_health_event(0.01) is None  # reported once
    with pytest.raises(GpuLostError):
        backend.get_compute_mode(T4)


def test_unknown_gpu(contract: Contract) -> None:
    backend, _ = contract
    with pytest.raises(NotFoundError):
        backend.get_compute_mode(5)
