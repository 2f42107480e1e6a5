"""Backend health events become device taints (or, without taints, withdrawn devices) and
device health for the kubelet; taints go once the GPU has been healthy for the period."""

from __future__ import annotations

import threading

import pytest

from flexgpu.driver.allocation import (
    allocate,
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from flexgpu.driver.resource_slice import slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.agents.health_monitor import NVML_FAILURES_BEFORE_FAULT, HealthMonitor
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import HealthStatus

PERIOD_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _monitor(
    topology: str = "l4-2-pcie", *, taints: bool = True
) -> tuple[SimulatedBackend, NodeDevices, HealthMonitor, list[str], Clock]:
    backend = SimulatedBackend.from_topology(topology, "node-a")
    devices = NodeDevices(backend, health_taints=taints)
    republished: list[str] = []
    clock = Clock()
    monitor = HealthMonitor(
        backend,
        devices,
        "node-a",
        on_change=lambda: republished.append("slices"),
        healthy_period_s=PERIOD_S,
        clock=clock,
    )
    return backend, devices, monitor, republished, clock


def _drain(backend: SimulatedBackend, monitor: HealthMonitor) -> None:
    while (event := backend.wait_health_event(0.05)) is not None:
        monitor.handle(event)


def _taints(devices: NodeDevices) -> dict[str, list[tuple[str, str, str]]]:
    return {
        d["name"]: [(t["key"], t["value"], t["effect"]) for t in d.get("taints", [])]
        for d in devices.slice_devices()
    }


def _health(monitor: HealthMonitor) -> dict[str, tuple[HealthStatus, str]]:
    return {h.device_name: (h.status, h.message) for h in monitor.snapshot()}


def _allocate_one(devices: NodeDevices) -> str | None:
    """What the scheduler's rules (driver.allocation, held to kube-scheduler by the
    differential test) give a new one-GPU claim from the published slices."""
    slices = [
        parse_slice({"metadata": {"name": f"s{i}"}, "spec": spec})
        for i, spec in enumerate(slice_specs("node-a", devices.slice_devices(), 1))
    ]
    cls = {"metadata": {"name": "gpu"}, "spec": {"selectors": []}}
    claim = parse_claim(
        {
            "metadata": {"name": "new", "namespace": "ns", "uid": "u"},
            "spec": {
                "devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "gpu"}}]}
            },
        }
    )
    node = parse_node({"metadata": {"name": "node-a", "labels": {}}})
    verdict = allocate([claim], node, slices, {"gpu": parse_device_class(cls)}, allocated_state([]))
    if verdict.outcome != "allocatable":
        return None
    return verdict.devices[0][0].device


@pytest.mark.parametrize(
    ("xid", "key", "effect"),
    [
        (79, "gpu.flexgpu.dev/gpu-lost", "NoSchedule"),
        (48, "gpu.flexgpu.dev/memory-error", "NoSchedule"),
    ],
)
def test_fatal_xid_taints_the_gpu_and_a_new_claim_avoids_it(
    xid: int, key: str, effect: str
) -> None:
    backend, devices, monitor, republished, _ = _monitor()
    assert _allocate_one(devices) == "gpu-0"
    backend.inject_xid(0, xid)
    _drain(backend, monitor)
    assert _taints(devices) == {"gpu-0": [(key, f"xid-{xid}", effect)], "gpu-1": []}
    assert republished == ["slices"]
    assert _allocate_one(devices) == "gpu-1"
    status, message = _health(monitor)["gpu-0"]
    assert status == HealthStatus.UNHEALTHY and message.startswith(f"Xid {xid}: ")
    assert _health(monitor)["gpu-1"] == (HealthStatus.HEALTHY, "")
    assert [g.health for g in devices.gpus()] == ["Unhealthy", "Healthy"]


def test_informational_xid_taints_with_effect_none_and_the_gpu_stays_usable() -> None:
    backend, devices, monitor, _, _ = _monitor()
    backend.inject_xid(0, 63)  # ECC row remap recorded: works until the next reset
    _drain(backend, monitor)
    assert _taints(devices)["gpu-0"] == [("gpu.flexgpu.dev/memory-error", "xid-63", "None")]
    assert _allocate_one(devices) == "gpu-0"
    status, message = _health(monitor)["gpu-0"]
    assert status == HealthStatus.HEALTHY and "row remap" in message


def test_an_informational_xid_never_softens_a_fatal_one() -> None:
    backend, devices, monitor, _, _ = _monitor()
    backend.inject_xid(0, 48)
    backend.inject_xid(0, 63)
    _drain(backend, monitor)
    assert _taints(devices)["gpu-0"] == [("gpu.flexgpu.dev/memory-error", "xid-48", "NoSchedule")]


def test_application_xid_and_ignored_xid_change_nothing() -> None:
    backend, devices, monitor, republished, _ = _monitor()
    monitor.set_ignored_xids(frozenset({48}))
    backend.inject_xid(0, 13)
    backend.inject_xid(1, 48)
    _drain(backend, monitor)
    assert republished == [] and _taints(devices) == {"gpu-0": [], "gpu-1": []}
    assert {s for s, _ in _health(monitor).values()} == {HealthStatus.HEALTHY}


def test_taint_clears_after_the_healthy_period_and_not_before() -> None:
    backend, devices, monitor, republished, clock = _monitor()
    backend.inject_xid(1, 48)
    _drain(backend, monitor)
    clock.now += PERIOD_S - 1
    monitor.check_recovery()
    assert _taints(devices)["gpu-1"] and _allocate_one(devices) == "gpu-0"
    backend.inject_xid(1, 48)  # seen again: the period starts over
    _drain(backend, monitor)
    clock.now += PERIOD_S - 1
    monitor.check_recovery()
    assert _taints(devices)["gpu-1"]
    clock.now += 1
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}
    assert republished == ["slices", "slices"]
    assert _health(monitor)["gpu-1"] == (HealthStatus.HEALTHY, "")


def test_lost_gpu_stays_published_tainted_until_back_for_the_period() -> None:
    backend, devices, monitor, republished, clock = _monitor()
    backend.lose_gpu(0)
    _drain(backend, monitor)
    devices.refresh()  # a later refresh must not drop or untaint the lost GPU
    assert _taints(devices)["gpu-0"] == [("gpu.flexgpu.dev/gpu-lost", "lost", "NoSchedule")]
    assert _health(monitor)["gpu-0"][0] == HealthStatus.UNHEALTHY
    assert _allocate_one(devices) == "gpu-1"
    clock.now += 10 * PERIOD_S  # still gone: the fault is still seen
    monitor.check_recovery()
    assert _taints(devices)["gpu-0"]
    backend.restore_gpu(0)
    monitor.check_recovery()
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}
    assert _health(monitor)["gpu-0"] == (HealthStatus.HEALTHY, "")
    assert len(republished) == 2


def test_without_taints_a_fatal_fault_withdraws_and_recovery_brings_it_back() -> None:
    backend, devices, monitor, _, clock = _monitor(taints=False)
    backend.inject_xid(1, 79)
    backend.inject_xid(0, 63)  # informational: published, without a taint the API would drop
    _drain(backend, monitor)
    assert _taints(devices) == {"gpu-0": []}
    assert _health(monitor)["gpu-1"][0] == HealthStatus.UNHEALTHY
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}


def test_nvml_failing_in_a_row_taints_every_gpu_until_it_answers() -> None:
    _, devices, monitor, _, clock = _monitor()
    for _ in range(NVML_FAILURES_BEFORE_FAULT - 1):
        monitor.nvml_failed("NVML_ERROR_UNKNOWN")
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}  # a hiccup is not a fault
    monitor.nvml_failed("NVML_ERROR_UNKNOWN")
    nvml = [("gpu.flexgpu.dev/nvml-unavailable", "unavailable", "NoSchedule")]
    assert _taints(devices) == {"gpu-0": nvml, "gpu-1": nvml}
    assert _allocate_one(devices) is None
    clock.now += 2 * PERIOD_S  # still failing: the fault is still seen
    monitor.check_recovery()
    assert _taints(devices)["gpu-0"] == nvml
    monitor.nvml_answered()
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}


def test_every_mig_device_of_a_faulty_gpu_is_tainted_and_reported() -> None:
    backend, devices, monitor, _, _ = _monitor("dgx-a100-8")
    backend.set_mig_mode(2, True)
    profile = next(p for p in backend.mig_profiles(2) if p.name == "3g.20gb")
    for placement in profile.placements:
        backend.create_mig_device(2, profile.profile_id, placement)
    devices.refresh()
    migs = [d["name"] for d in devices.slice_devices() if d["name"].startswith("gpu-2-")]
    assert len(migs) == 2
    backend.inject_xid(2, 48)
    _drain(backend, monitor)
    taints = _taints(devices)
    assert all(
        taints[m] == [("gpu.flexgpu.dev/memory-error", "xid-48", "NoSchedule")] for m in migs
    )
    health = _health(monitor)
    assert all(health[m][0] == HealthStatus.UNHEALTHY for m in migs)
    assert health["gpu-3"] == (HealthStatus.HEALTHY, "")


def test_the_event_loop_delivers_and_survives_backend_failures() -> None:
    backend, devices, monitor, _, _ = _monitor()
    changed = threading.Event()
    monitor.subscribe(changed.set)
    backend.faults.fail_next("wait_health_event", 1)
    monitor.start()
    try:
        backend.inject_xid(1, 79)
        assert changed.wait(10)
    finally:
        monitor.stop()
    assert _taints(devices)["gpu-1"][0][0] == "gpu.flexgpu.dev/gpu-lost"


@pytest.mark.parametrize(
    ("taints", "consequence"),
    [
        (True, "its devices are tainted gpu.flexgpu.dev/memory-error=xid-48:NoSchedule"),
        (False, "it is withdrawn from the ResourceSlices"),
    ],
)
def test_each_new_fault_and_its_clearing_is_an_event_on_the_node(
    taints: bool, consequence: str
) -> None:
    backend = SimulatedBackend.from_topology("l4-2-pcie", "node-a")
    devices = NodeDevices(backend, health_taints=taints)
    clock = Clock()
    recorded: list[tuple[str, str]] = []
    monitor = HealthMonitor(
        backend,
        devices,
        "node-a",
        healthy_period_s=PERIOD_S,
        clock=clock,
        events=lambda reason, message: recorded.append((reason, message)),
    )
    backend.inject_xid(1, 48)
    backend.inject_xid(1, 48)  # the same fault again: no second Event
    _drain(backend, monitor)
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert [r for r, _ in recorded] == ["GpuFault", "GpuFaultCleared"]
    assert recorded[0][1].startswith("GPU 1 (GPU-") and recorded[0][1].endswith(consequence)
    assert "memory-error cleared" in recorded[1][1]


@pytest.mark.parametrize("dynamic", [False, True])
def test_an_xid_naming_a_gpu_instance_taints_only_that_mig_device(dynamic: bool) -> None:
    backend = SimulatedBackend.from_topology("dgx-a100-8", "node-a")
    backend.set_mig_mode(2, True)
    profile = next(p for p in backend.mig_profiles(2) if p.name == "3g.20gb")
    # Two 3g.20gb instances: made beforehand (adopted), or as prepare makes them (dynamic).
    made = [backend.create_mig_device(2, profile.profile_id, pl) for pl in profile.placements]
    devices = NodeDevices(backend, dynamic_mig={2} if dynamic else set())
    names = [f"gpu-2-mig-3g20gb-{pl.start}" for pl in profile.placements]
    monitor = HealthMonitor(backend, devices, "node-a", healthy_period_s=PERIOD_S, clock=Clock())
    backend.inject_xid(2, 94, gpu_instance_id=made[1].gpu_instance_id)
    _drain(backend, monitor)
    taints = _taints(devices)
    assert taints[names[1]] == [("gpu.flexgpu.dev/memory-error", "xid-94", "None")]
    assert taints[names[0]] == []
    backend.inject_xid(2, 48, gpu_instance_id=made[0].gpu_instance_id)
    _drain(backend, monitor)
    health = _health(monitor)
    assert health[names[0]][0] == HealthStatus.UNHEALTHY
    assert health[names[1]][0] == HealthStatus.HEALTHY
    assert _taints(devices)["gpu-3"] == [] and devices.gpus()[2].health == "Healthy"
