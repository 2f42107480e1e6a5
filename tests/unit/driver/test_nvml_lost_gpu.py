"""A GPU lost while the NVML backend waits on its event set. NVML answers every wait on a set
that holds a lost GPU with GPU_IS_LOST at once, without saying which GPU: the backend finds
the GPU by asking each one, reports it once (a GPU_LOST event, tainted gpu-lost by the health
monitor), waits on a set built without it so the other GPUs' events keep coming and the wait
blocks again, and watches the GPU again once it is back. Over the stand-in (tests/unit/driver/
fake_pynvml.py) for the paths the NVML mock library cannot take, and over the library itself."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import LibraryNode
from fake_pynvml import FakeNvml, t4

from flexgpu.driver.backend_errors import GpuLostError
from flexgpu.driver.gpu_model import HealthEvent, HealthEventKind
from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.driver.sysfs import SysfsPci
from flexgpu.kubelet_plugin.agents.health_monitor import NVML_FAILURES_BEFORE_FAULT, HealthMonitor
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from tests.conftest import holds_for, wait_for

LOST = ("gpu.flexgpu.dev/gpu-lost", "lost", "NoSchedule")


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-3333-4000-8000-000000000000"


def _bus(i: int) -> str:
    return f"00000000:{0x40 + i:02X}:00.0"


def _fake(tmp_path: Path, count: int = 3) -> tuple[NvmlBackend, FakeNvml]:
    nvml = FakeNvml([t4(_uuid(i), _bus(i)) for i in range(count)])
    return NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path)), nvml


def _kind(event: HealthEvent | None) -> tuple[HealthEventKind, int, int | None] | None:
    return None if event is None else (event.kind, event.gpu_index, event.xid)


def _taints(devices: NodeDevices) -> dict[str, list[tuple[str, str, str]]]:
    return {
        d["name"]: [(t["key"], t["value"], t["effect"]) for t in d.get("taints", [])]
        for d in devices.slice_devices()
    }


def test_a_lost_gpu_in_the_set_is_reported_once_and_the_others_are_still_watched(
    tmp_path: Path,
) -> None:
    backend, nvml = _fake(tmp_path)
    assert backend.wait_health_event(0) is None  # the set now watches GPUs 0-2
    nvml.lose_gpu(1)
    event = backend.wait_health_event(5)
    assert _kind(event) == (HealthEventKind.GPU_LOST, 1, None)
    assert event is not None and event.gpu_uuid == _uuid(1)
    nvml.raise_xid(1, 48)  # from the lost GPU: never delivered on the new set
    nvml.raise_xid(2, 48)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.XID, 2, 48)
    # The set was built again without GPU 1 (and the old one freed), so a wait blocks again
    # instead of answering GPU_IS_LOST at once: one wait, its full timeout, nothing.
    waits = nvml.calls.count("nvmlEventSetWait")
    started = time.monotonic()
    assert backend.wait_health_event(0.3) is None
    assert time.monotonic() - started >= 0.25
    assert nvml.calls.count("nvmlEventSetWait") == waits + 1
    assert (nvml.calls.count("nvmlEventSetCreate"), nvml.calls.count("nvmlEventSetFree")) == (2, 1)


def test_a_gpu_back_on_the_bus_is_watched_again_and_reported_if_lost_again(
    tmp_path: Path,
) -> None:
    backend, nvml = _fake(tmp_path, count=2)
    assert backend.wait_health_event(0) is None
    nvml.lose_gpu(1)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.GPU_LOST, 1, None)
    nvml.gpus[1].lost = False
    assert [g.index for g in backend.list_gpus()] == [0, 1]  # the health monitor's check
    assert backend.wait_health_event(0) is None  # waits on a set holding GPU 1 again
    nvml.raise_xid(1, 79)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.XID, 1, 79)
    nvml.lose_gpu(1)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.GPU_LOST, 1, None)


def test_events_still_queued_in_the_set_it_replaces_are_delivered(tmp_path: Path) -> None:
    backend, nvml = _fake(tmp_path)
    assert backend.wait_health_event(0) is None
    nvml.raise_xid(0, 48)
    nvml.lose_gpu(1)
    # Another thread's enumeration finds GPU 1 first (the plugin reads its GPUs for slices).
    assert [g.index for g in backend.list_gpus()] == [0, 2]
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.GPU_LOST, 1, None)
    # The set is built again before the next wait; GPU 0's Xid, raised into the old one, is
    # taken from it first instead of being freed with it.
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.XID, 0, 48)
    assert backend.wait_health_event(0) is None


def test_an_xid_whose_gpu_is_lost_before_it_is_read_reports_the_gpu_lost(
    tmp_path: Path,
) -> None:
    # Xid 79 comes as its GPU falls off the bus: by the time the event is read, the GPU named
    # in it answers GPU_IS_LOST to the UUID query.
    backend, nvml = _fake(tmp_path, count=2)
    assert backend.wait_health_event(0) is None
    nvml.raise_xid(0, 79)
    nvml.lose_gpu(0)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.GPU_LOST, 0, None)
    assert backend.wait_health_event(0) is None


def test_gpu_is_lost_with_every_gpu_answering_is_a_failed_wait(tmp_path: Path) -> None:
    backend, nvml = _fake(tmp_path, count=2)
    nvml.wait_answers_lost = True
    # Nothing to build the set without: answering None would have the caller wait again at
    # once, forever. A failed wait makes it back off (and count NVML unavailable if it lasts).
    with pytest.raises(GpuLostError, match="yet every GPU of the node answers"):
        backend.wait_health_event(5)
    assert [g.index for g in backend.list_gpus()] == [0, 1]


def test_the_health_loop_taints_the_lost_gpu_keeps_watching_and_never_spins(
    tmp_path: Path,
) -> None:
    backend, nvml = _fake(tmp_path)
    devices = NodeDevices(backend)
    monitor = HealthMonitor(backend, devices, "n")
    monitor.start()
    try:
        wait_for(lambda: nvml.calls.count("nvmlEventSetWait") > 0, what="the first event wait")
        nvml.lose_gpu(1)
        wait_for(lambda: _taints(devices)["gpu-1"] == [LOST], what="gpu-1 tainted gpu-lost")
        nvml.raise_xid(0, 48)
        memory = ("gpu.flexgpu.dev/memory-error", "xid-48", "NoSchedule")
        wait_for(lambda: _taints(devices)["gpu-0"] == [memory], what="gpu-0 tainted after Xid 48")
        assert _taints(devices)["gpu-2"] == []
        waits = nvml.calls.count("nvmlEventSetWait")
        # The loop waits up to 1 s per call: over 3 s a few calls, where a set still holding
        # the lost GPU would be asked thousands of times.
        holds_for(
            lambda: nvml.calls.count("nvmlEventSetWait") - waits <= 8,
            3.0,
            "three 1 s event waits of the health loop",
        )
    finally:
        monitor.stop()


def test_the_health_loop_counts_an_unexplained_gpu_is_lost_as_nvml_failing(
    tmp_path: Path,
) -> None:
    backend, nvml = _fake(tmp_path, count=2)
    devices = NodeDevices(backend)
    monitor = HealthMonitor(backend, devices, "n")
    nvml.wait_answers_lost = True
    for _ in range(NVML_FAILURES_BEFORE_FAULT):
        with pytest.raises(GpuLostError) as failed:
            backend.wait_health_event(1)
        monitor.nvml_failed(str(failed.value))  # what the loop does with a failed wait
    unavailable = ("gpu.flexgpu.dev/nvml-unavailable", "unavailable", "NoSchedule")
    assert _taints(devices) == {"gpu-0": [unavailable], "gpu-1": [unavailable]}


# -- over the NVML mock library ------------------------------------------------------------


def _machine(count: int) -> dict[str, Any]:
    return {
        "gpus": [
            {"model": "H100-SXM5-80GB", "uuid": _uuid(i), "pciBusId": f"0000:{0x40 + i:02x}:00.0"}
            for i in range(count)
        ]
    }


def test_the_library_answers_gpu_is_lost_and_the_backend_rebuilds_its_set(
    library_node: LibraryNode,
) -> None:
    backend, machine = library_node(_machine(3))
    assert backend.wait_health_event(0) is None  # the set now watches GPUs 0-2
    machine.set_lost(2)
    # Found through the wait's own answer: nothing else enumerates the GPUs here.
    assert _kind(backend.wait_health_event(10)) == (HealthEventKind.GPU_LOST, 2, None)
    machine.inject_xid(0, 48)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.XID, 0, 48)
    started = time.monotonic()
    assert backend.wait_health_event(0.3) is None
    assert time.monotonic() - started >= 0.25, "the wait answered at once: GPU 2 still in the set"
    machine.set_lost(2, False)
    assert len(backend.list_gpus()) == 3
    assert backend.wait_health_event(0) is None
    machine.inject_xid(2, 63)
    assert _kind(backend.wait_health_event(5)) == (HealthEventKind.XID, 2, 63)
