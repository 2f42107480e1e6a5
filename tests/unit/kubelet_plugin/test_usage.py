"""GPU usage per device and per claim: whole GPUs from the device figures, MIG instances
from their own processes, shares from the processes of the pods each share is reserved for;
GPU-seconds and idle time from the sampler's clock; the simulated usage file drives it all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from flexgpu.driver.gpu_model import ProcessSample
from flexgpu.driver.names import mig_device_name
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sim_usage import USAGE_FILE_NAME
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, ClaimState, DeviceRecord
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.observe.pod_cgroup import pod_uid_in
from flexgpu.kubelet_plugin.observe.usage import UsageSampler
from flexgpu.kubelet_plugin.observe.usage_metrics import UsageCollector
from flexgpu.kubelet_plugin.observe.usage_model import UsageSettings
from tests.conftest import wait_for

NODE = "node-a"
POD_A = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
POD_B = "6fa459ea-ee8a-3ca4-894e-db77e160355e"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(name: str, *devices: DeviceRecord) -> ClaimRecord:
    return ClaimRecord(
        uid=f"uid-{name}",
        namespace="team",
        name=name,
        state=ClaimState.PREPARED,
        devices=list(devices),
    )


def claim_object(pods: dict[str, str], klass: str = "gpu.flexgpu.dev") -> dict[str, Any]:
    return {
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": klass}}]}},
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": name, "uid": uid} for name, uid in pods.items()
            ]
        },
    }


def sampler_for(
    backend: SimulatedBackend,
    devices: NodeDevices,
    records: list[ClaimRecord],
    objects: dict[str, dict[str, Any]],
    clock: Clock,
    proc_root: Path = Path("/nonexistent"),
) -> UsageSampler:
    return UsageSampler(
        NODE,
        backend,
        devices=devices,
        records=lambda: records,
        claim_object=lambda r: objects.get(r.uid),
        settings=UsageSettings(interval_s=10, idle_threshold=0.05, proc_root=proc_root),
        clock=clock,
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_whole_gpus_busy_and_idle_with_gpu_seconds_and_idle_time(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_topology("l4-2-pcie", NODE, state_path=tmp_path / "s.json")
    devices = NodeDevices(backend)
    records = [
        record("busy", DeviceRecord(pool_name=NODE, device_name="gpu-0")),
        record("idle", DeviceRecord(pool_name=NODE, device_name="gpu-1")),
    ]
    objects = {"uid-busy": claim_object({"trainer": POD_A}), "uid-idle": claim_object({})}
    # The simulated node reads its load from the file beside its state.
    load = {"gpus": {"0": {"processes": [{"pid": 7, "usedMemoryMiB": 1024, "smUtilization": 80}]}}}
    (tmp_path / USAGE_FILE_NAME).write_text(json.dumps(load))
    clock = Clock()
    sampler = sampler_for(backend, devices, records, objects, clock)
    sampler.sample_once()
    clock.now += 10
    snap = sampler.sample_once()
    registry = CollectorRegistry()
    registry.register(UsageCollector(sampler))

    busy = dict(node=NODE, namespace="team", claim="busy", device="gpu-0", product="NVIDIA L4") | {
        "class": "gpu.flexgpu.dev",
        "profile": "",
        "share": "",
        "pods": "trainer",
    }
    assert sample(registry, "flexgpu_claim_sm_utilization_ratio", **busy) == 0.8
    assert sample(registry, "flexgpu_claim_memory_used_bytes", **busy) == 1024 * 2**20
    assert sample(registry, "flexgpu_claim_processes", **busy) == 1
    assert sample(registry, "flexgpu_claim_allocated_gpu_seconds_total", **busy) == 10
    assert sample(registry, "flexgpu_claim_used_gpu_seconds_total", **busy) == 8
    idle = busy | {"claim": "idle", "device": "gpu-1", "pods": ""}
    assert sample(registry, "flexgpu_claim_sm_utilization_ratio", **idle) == 0
    assert snap.idle_seconds == {"uid-busy": None, "uid-idle": 10}
    gpu0 = {"node": NODE, "device": "gpu-0", "product": "NVIDIA L4", "claims": "team/busy"}
    assert sample(registry, "flexgpu_gpu_sm_utilization_ratio", **gpu0) == 0.8

    # The idle claim gets busy: its idle time starts again from zero.
    load["gpus"]["1"] = {"smUtilization": 30, "processes": [{"pid": 8, "smUtilization": 30}]}
    (tmp_path / USAGE_FILE_NAME).write_text(json.dumps(load))
    clock.now += 10
    assert sampler.sample_once().idle_seconds["uid-idle"] is None
    # Unprepared: its series go.
    records.pop(0)
    clock.now += 10
    sampler.sample_once()
    assert sample(registry, "flexgpu_claim_allocated_gpus", **busy) is None


def test_mig_instance_figures_come_from_its_own_processes() -> None:
    backend = SimulatedBackend.from_topology("dgx-a100-8", NODE)
    backend.set_mig_mode(0, True)
    profile = next(p for p in backend.mig_profiles(0) if p.name == "1g.10gb")
    instance = backend.create_mig_device(0, profile.profile_id, profile.placements[0])
    other = backend.create_mig_device(0, profile.profile_id, profile.placements[1])
    devices = NodeDevices(backend)
    name = mig_device_name(0, "1g.10gb", profile.placements[0].start)
    backend.set_processes(
        0,
        [
            ProcessSample(
                pid=5,
                used_memory_mib=500,
                sm_utilization_percent=60,
                gpu_instance_id=instance.gpu_instance_id,
            ),
            ProcessSample(
                pid=6,
                used_memory_mib=100,
                sm_utilization_percent=90,
                gpu_instance_id=other.gpu_instance_id,
            ),
        ],
    )
    records = [record("part", DeviceRecord(pool_name=NODE, device_name=name))]
    clock = Clock()
    sampler = sampler_for(backend, devices, records, {}, clock)
    (device,) = sampler.sample_once().devices
    assert (device.kind, device.profile, device.device_class) == (
        "mig",
        "1g.10gb",
        "mig.flexgpu.dev",
    )
    assert device.sm_utilization == 0.6 and device.memory_used_bytes == 500 * 2**20
    # A 1g instance holds 14 of the A100's 108 multiprocessors; busy GPUs count that part.
    assert device.allocated_gpus == profile.multiprocessors / 108
    assert device.used_gpus == pytest.approx(0.6 * profile.multiprocessors / 108)


def test_shares_get_the_usage_of_their_own_pods_processes(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_topology("l4-2-pcie", NODE)
    devices = NodeDevices(backend, shared={0})
    proc = tmp_path / "proc"
    for pid, pod in ((11, POD_A), (12, POD_B)):
        (proc / str(pid)).mkdir(parents=True)
        # systemd cgroup driver: the pod UID with underscores.
        slice_name = f"kubepods-burstable-pod{pod.replace('-', '_')}.slice"
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods.slice/{slice_name}/cri-x.scope\n")
    backend.set_processes(
        0,
        [
            ProcessSample(pid=11, used_memory_mib=300, sm_utilization_percent=40),
            ProcessSample(pid=12, used_memory_mib=200, sm_utilization_percent=2),
        ],
    )

    def share(share_id: str, compute: str) -> DeviceRecord:
        return DeviceRecord(
            pool_name=NODE,
            device_name="gpu-0",
            share_id=share_id,
            consumed_capacity={"memory": "4Gi", "compute": compute},
        )

    records = [record("a", share("s-a", "50")), record("b", share("s-b", "25"))]
    klass = "shared-gpu.flexgpu.dev"
    objects = {
        "uid-a": claim_object({"pa": POD_A}, klass),
        "uid-b": claim_object({"pb": POD_B}, klass),
    }
    sampler = sampler_for(backend, devices, records, objects, Clock(), proc)
    by_claim = {d.claim: d for d in sampler.sample_once().devices}
    assert by_claim["a"].sm_utilization == 0.4 and by_claim["a"].allocated_gpus == 0.5
    assert by_claim["b"].sm_utilization == 0.02 and by_claim["b"].share == "s-b"
    assert by_claim["b"].memory_used_bytes == 200 * 2**20

    # A process of no share's pod: the shares have no figures, the GPU lists them.
    backend.set_processes(0, [ProcessSample(pid=99, sm_utilization_percent=50)])
    snap = sampler.sample_once()
    assert all(d.sm_utilization is None for d in snap.devices)
    assert snap.gpus[0].claims == ("team/a", "team/b")
    assert snap.idle_seconds == {"uid-a": None, "uid-b": None}


def test_pod_uid_from_both_cgroup_drivers() -> None:
    assert pod_uid_in(f"0::/kubepods/burstable/pod{POD_A}/abc\n") == POD_A
    systemd = f"0::/kubepods.slice/kubepods-pod{POD_B.replace('-', '_')}.slice/cri.scope"
    assert pod_uid_in(systemd) == POD_B
    assert pod_uid_in("0::/system.slice/containerd.service\n") is None


def test_the_sampling_thread_survives_a_failing_sample_and_stops_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Started, the sampler samples at once; a sample that raises is logged and retried (the
    thread lives on) and the next good one is published; stop() leaves no thread behind."""
    backend = SimulatedBackend.from_topology("l4-2-pcie", NODE, state_path=tmp_path / "s.json")
    calls: list[int] = []

    def records() -> list[ClaimRecord]:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("checkpoint unreadable")
        return [record("busy", DeviceRecord(pool_name=NODE, device_name="gpu-0"))]

    sampler = UsageSampler(
        NODE,
        backend,
        devices=NodeDevices(backend),
        records=records,
        claim_object=lambda r: claim_object({}),
        settings=UsageSettings(interval_s=0.01, proc_root=Path("/nonexistent")),
    )
    sampler.start()
    try:
        wait_for(lambda: bool(sampler.snapshot.devices), what="a sample after the failed one")
        assert "checkpoint unreadable" in caplog.text
        assert sampler.running
    finally:
        sampler.stop()
    assert not sampler.running
