"""Backend health events become device health for the kubelet and leave the slices."""

from __future__ import annotations

import threading

from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.health_monitor import HealthMonitor
from flexgpu.kubelet_plugin.kubeletplugin import HealthStatus
from flexgpu.kubelet_plugin.node_devices import NodeDevices


def _monitor() -> tuple[SimulatedBackend, NodeDevices, HealthMonitor, list[str]]:
    backend = SimulatedBackend.from_topology("l4-2-pcie", "node-a")
    devices = NodeDevices(backend)
    republished: list[str] = []
    monitor = HealthMonitor(
        backend, devices, "node-a", on_unhealthy=lambda: republished.append("slices")
    )
    return backend, devices, monitor, republished


def test_hardware_xid_marks_gpu_unhealthy_notifies_and_unpublishes() -> None:
    backend, devices, monitor, republished = _monitor()
    changed = threading.Event()
    monitor.subscribe(changed.set)
    monitor.start()
    try:
        backend.inject_xid(1, 79)  # fallen off the bus: a hardware fault
        assert changed.wait(5)
    finally:
        monitor.stop()
    health = {h.device_name: h for h in monitor.snapshot()}
    assert health["gpu-1"].status == HealthStatus.UNHEALTHY
    assert health["gpu-1"].message == "Xid 79"
    assert health["gpu-0"].status == HealthStatus.HEALTHY
    assert republished == ["slices"]
    assert [d["name"] for d in devices.slice_devices()] == ["gpu-0"]


def test_application_xid_leaves_gpu_healthy() -> None:
    backend, _, monitor, republished = _monitor()
    events = []
    backend.inject_xid(0, 13)
    while (event := backend.wait_health_event(0.1)) is not None:
        events.append(event)
        monitor.handle(event)
    assert events and republished == []
    assert {h.status for h in monitor.snapshot()} == {HealthStatus.HEALTHY}


def test_lost_gpu_is_reported_once() -> None:
    backend, _, monitor, republished = _monitor()
    backend.lose_gpu(0)
    while (event := backend.wait_health_event(0.1)) is not None:
        monitor.handle(event)
        monitor.handle(event)
    assert republished == ["slices"]
    assert {h.device_name: h.message for h in monitor.snapshot()}["gpu-0"].startswith("GPU lost")
