"""The node's devices on the NVML backend over the NVML mock library: faults injected in the
library (Xid 79, 48, 63, a GPU lost and back) become device taints that go after the healthy
period, and MIG layouts made beforehand by another tool (as mig-parted makes them, through
NVML) are published as they are, with their real UUIDs, never as whole GPUs."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import LibraryNode

from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.kubelet_plugin.agents.health_monitor import HealthMonitor
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import HealthStatus

PERIOD_S = 30.0


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-2222-4000-8000-000000000000"


def _machine(models: list[str], mig: frozenset[int] = frozenset()) -> dict[str, Any]:
    return {
        "gpus": [
            {
                "model": model,
                "uuid": _uuid(i),
                "pciBusId": f"0000:{0x20 + i:02x}:00.0",
                "migEnabled": i in mig,
            }
            for i, model in enumerate(models)
        ]
    }


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _taints(devices: NodeDevices) -> dict[str, list[tuple[str, str, str]]]:
    return {
        d["name"]: [(t["key"], t["value"], t["effect"]) for t in d.get("taints", [])]
        for d in devices.slice_devices()
    }


def _drain(backend: NvmlBackend, monitor: HealthMonitor) -> int:
    handled = 0
    while (event := backend.wait_health_event(0.2)) is not None:
        monitor.handle(event)
        handled += 1
    return handled


def test_injected_xids_taint_by_class_and_clear_after_the_period(
    library_node: LibraryNode,
) -> None:
    backend, machine = library_node(_machine(["H100-SXM5-80GB"] * 3))
    devices = NodeDevices(backend)
    clock = Clock()
    monitor = HealthMonitor(backend, devices, "n", healthy_period_s=PERIOD_S, clock=clock)
    backend.wait_health_event(0.01)  # registers for events before the faults are raised
    machine.inject_xid(0, 79)
    machine.inject_xid(1, 48)
    machine.inject_xid(2, 63)
    assert _drain(backend, monitor) == 3
    assert _taints(devices) == {
        "gpu-0": [("gpu.flexgpu.dev/gpu-lost", "xid-79", "NoSchedule")],
        "gpu-1": [("gpu.flexgpu.dev/memory-error", "xid-48", "NoSchedule")],
        "gpu-2": [("gpu.flexgpu.dev/memory-error", "xid-63", "None")],
    }
    health = {h.device_name: h.status for h in monitor.snapshot()}
    assert health == {
        "gpu-0": HealthStatus.UNHEALTHY,
        "gpu-1": HealthStatus.UNHEALTHY,
        "gpu-2": HealthStatus.HEALTHY,
    }
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": [], "gpu-2": []}


def test_a_lost_gpu_is_tainted_while_gone_and_cleared_once_back_for_the_period(
    library_node: LibraryNode,
) -> None:
    backend, machine = library_node(_machine(["A100-SXM4-80GB"] * 2))
    devices = NodeDevices(backend)
    clock = Clock()
    monitor = HealthMonitor(backend, devices, "n", healthy_period_s=PERIOD_S, clock=clock)
    machine.set_lost(1)
    devices.refresh()  # the plugin notices on its next read of the GPUs
    _drain(backend, monitor)
    assert _taints(devices)["gpu-1"] == [("gpu.flexgpu.dev/gpu-lost", "lost", "NoSchedule")]
    clock.now += 5 * PERIOD_S
    monitor.check_recovery()
    assert _taints(devices)["gpu-1"], "cleared while the GPU was still gone"
    machine.set_lost(1, False)
    monitor.check_recovery()
    clock.now += PERIOD_S
    monitor.check_recovery()
    assert _taints(devices) == {"gpu-0": [], "gpu-1": []}
    machine.set_lost(1)  # lost again: reported again
    devices.refresh()
    _drain(backend, monitor)
    assert _taints(devices)["gpu-1"][0][0] == "gpu.flexgpu.dev/gpu-lost"


# mig-parted style layouts: an A100 split "all-1g.10gb", an H100 split unevenly.
LAYOUTS = {
    "A100-SXM4-80GB": {"1g.10gb": 7},
    "H100-SXM5-80GB": {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
}


def _lay_out(backend: NvmlBackend, index: int, layout: dict[str, int]) -> None:
    """Creates the layout through NVML, largest profile first, as mig-parted applies one."""
    profiles = {p.name: p for p in backend.mig_profiles(index)}
    for name, count in sorted(layout.items(), key=lambda kv: -profiles[kv[0]].memory_slices):
        for _ in range(count):
            taken = {d.placement.start for d in backend.list_mig_devices(index)}
            free = [
                p
                for p in backend.possible_placements(index, profiles[name].profile_id)
                if p.start not in taken
            ]
            for placement in free:
                try:
                    backend.create_mig_device(index, profiles[name].profile_id, placement)
                    break
                except Exception:  # overlaps another instance: try the next placement
                    continue
            else:
                raise AssertionError(f"no room for {name} on GPU {index}")


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_a_gpu_laid_out_beforehand_publishes_its_mig_devices_with_their_uuids(
    library_node: LibraryNode, model: str
) -> None:
    backend, _ = library_node(_machine([model, model], mig=frozenset({0})))
    _lay_out(backend, 0, LAYOUTS[model])
    made = {d.uuid: d for d in backend.list_mig_devices(0)}
    assert len(made) == sum(LAYOUTS[model].values())

    devices = NodeDevices(backend)  # no GpuNodePolicy, no flags: nothing asks for MIG
    published = {d["name"]: d for d in devices.slice_devices()}
    mig = {n: d for n, d in published.items() if n.startswith("gpu-0-")}
    assert "gpu-0" not in published, "a GPU in MIG mode published whole"
    assert "gpu-1" in published
    assert {d["attributes"]["uuid"]["string"] for d in mig.values()} == set(made)
    profiles = sorted(d["attributes"]["profile"]["string"] for d in mig.values())
    assert profiles == sorted(p for p, n in LAYOUTS[model].items() for _ in range(n))
    for name in mig:
        assert devices.device_type(name) == "mig"
        resolved = devices.resolve(name)
        assert resolved is not None and resolved.uuid in made
    # Publishing changed nothing on the GPU.
    assert set(made) == {d.uuid for d in backend.list_mig_devices(0)}
