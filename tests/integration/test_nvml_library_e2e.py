"""The kubelet plugin end to end on the NVML backend, through the unmodified pynvml module over
the NVML mock library (tools/nvml-mock, NVIDIA's mock NVML servers behind NVML's C interface):
whole GPUs, an NVLink pair, a MIG partition created on demand at the placement the scheduler
allocated and destroyed on release, a restart that adopts the instance it made before, and a
GPU taken out of service by an injected Xid, and a GPU lost from under the plugin. The
library's state file is the hardware."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from bench.procstat import cpu_seconds
from flexgpu.controller import cli
from tests.conftest import holds_for, target_minor, wait_for
from tests.integration.gpu_workloads import (
    DRIVER,
    allocated,
    create_claim,
    ensure_device_classes,
    env_from_log,
    gpu_request,
    make_pod,
    pending_reason,
    wait_container_output,
    wait_gone,
    wait_phase,
)
from tests.nvml_library import MockMachine
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

NODE = "e2e-nvml"
RECOVERY_S = 15  # the plugin's healthy period before a fault's taint goes
PRINT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_)' | sort; echo DONE; sleep 120"
UUIDS = [f"GPU-{i:08x}-1111-4000-8000-00000000e2e0" for i in range(4)]
# GPUs 0 and 1 are an NVLink pair; GPU 2 is an A100 whose MIG partitions are made on demand.
MACHINE = {
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {"model": "H100-SXM5-80GB", "uuid": UUIDS[0], "pciBusId": "0000:18:00.0"},
        {"model": "H100-SXM5-80GB", "uuid": UUIDS[1], "pciBusId": "0000:2a:00.0"},
        {
            "model": "A100-SXM4-80GB",
            "uuid": UUIDS[2],
            "pciBusId": "0000:3a:00.0",
            "migEnabled": True,
        },
        {"model": "H100-SXM5-80GB", "uuid": UUIDS[3], "pciBusId": "0000:5d:00.0"},
    ],
    "nvlinks": [{"gpus": [0, 1], "links": 4}],
}


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory) -> MockMachine:
    return MockMachine.write(tmp_path_factory.mktemp("nvml"), MACHINE)


def _plugin_env(machine: MockMachine) -> dict[str, str]:
    return {**os.environ, **machine.env()}


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any, machine: MockMachine) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    started = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "mixed",  # a label only: the NVML backend reads the library's machine
        plugin_args=(
            "--gpu-backend=nvml",
            "--dynamic-mig-gpus=2",
            f"--health-recovery-period={RECOVERY_S}s",
        ),
        plugin_env=_plugin_env(machine),
    )
    try:
        started.start()
        yield started
    finally:
        started.cleanup()


def instances(machine: MockMachine, gpu: int = 2) -> list[dict[str, Any]]:
    """GPU instances the library holds for one GPU, from its state file."""
    state = json.loads(Path(machine.state_path).read_text())
    return list(state["gpus"].get(UUIDS[gpu], {}).get("gpuInstances") or [])


def published(api: Any) -> set[str]:
    slices = (
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}")
        .items
    )
    return {d.name for s in slices for d in s.spec.devices or []}


def run(
    api: Any, namespace: str, node: SimulatedGpuNode, name: str, devices: dict[str, Any]
) -> dict[str, str]:
    create_claim(api, namespace, name, devices)
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
    )
    wait_phase(api, namespace, name, {"Running"}, timeout_s=90)
    return env_from_log(wait_container_output(node, namespace, name, "DONE"))


def visible_uuids(env: dict[str, str]) -> list[str]:
    """UUIDs the container was given: one FLEXGPU_DEVICE_* variable per CDI device
    (``uuid=...;claim=...;device=...``), or NVIDIA_VISIBLE_DEVICES where the specs list them."""
    per_device = [
        dict(part.split("=", 1) for part in value.split(";") if "=" in part).get("uuid", "")
        for name, value in env.items()
        if name.startswith("FLEXGPU_DEVICE_")
    ]
    if per_device:
        return sorted(per_device)
    return sorted(env.get("NVIDIA_VISIBLE_DEVICES", "").split(","))


def release(api: Any, namespace: str, name: str) -> None:
    client.CoreV1Api(api).delete_namespaced_pod(name, namespace)
    wait_gone(api, namespace, name)
    client.ResourceV1Api(api).delete_namespaced_resource_claim(name, namespace)


def mig_request(profile: str) -> dict[str, Any]:
    is_profile = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {
        "requests": [
            {
                "name": "mig",
                "exactly": {
                    "deviceClassName": "mig.flexgpu.dev",
                    "selectors": [{"cel": {"expression": is_profile}}],
                },
            }
        ]
    }


def test_whole_gpu_carries_the_library_uuid(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    cel = f'device.attributes["{DRIVER}"].index == 3'
    env = run(api, namespace, node, "whole", {"requests": [gpu_request(cel=cel)]})
    assert [r.device for r in allocated(api, namespace, "whole")] == ["gpu-3"]
    assert visible_uuids(env) == [UUIDS[3]]
    release(api, namespace, "whole")


def test_nvlink_pair_from_the_library_wiring(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    pair = {
        "requests": [gpu_request(count=2)],
        "constraints": [{"requests": ["gpu"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}],
    }
    env = run(api, namespace, node, "pair", pair)
    assert sorted(r.device for r in allocated(api, namespace, "pair")) == ["gpu-0", "gpu-1"]
    assert visible_uuids(env) == UUIDS[:2]
    release(api, namespace, "pair")


def test_partition_made_at_the_allocated_placement_and_destroyed_on_release(
    api: Any, namespace: str, node: SimulatedGpuNode, machine: MockMachine
) -> None:
    env = run(api, namespace, node, "part", mig_request("3g.40gb"))
    (result,) = allocated(api, namespace, "part")
    start = int(result.device.rsplit("-", 1)[1])
    assert result.device == f"gpu-2-mig-3g40gb-{start}"
    (made,) = instances(machine)
    assert (made["start"], made["size"]) == (start, 4)
    (compute,) = made["computeInstances"]
    assert visible_uuids(env) == [compute["uuid"]] and compute["uuid"].startswith("MIG-")
    release(api, namespace, "part")
    assert instances(machine) == []


def test_restart_adopts_the_instance_it_made(
    api: Any, namespace: str, node: SimulatedGpuNode, machine: MockMachine
) -> None:
    env = run(api, namespace, node, "kept", mig_request("1g.10gb"))
    (made,) = instances(machine)
    node.stop_plugin(signal.SIGKILL)
    node.start_plugin(timeout_s=90)
    # The new process found the instance in the library, left it to the running pod, and
    # still owns it: releasing the claim destroys exactly that instance.
    assert instances(machine) == [made]
    assert visible_uuids(env) == [made["computeInstances"][0]["uuid"]]
    release(api, namespace, "kept")
    wait_for(lambda: instances(machine) == [], what="the adopted instance destroyed on release")


def taints(api: Any) -> dict[str, list[tuple[str, str, str]]]:
    """Published devices and their taints, read as JSON (the client's models may predate
    device taints)."""
    response = client.ResourceV1Api(api).list_resource_slice(
        field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}", _preload_content=False
    )
    return {
        d["name"]: [(t["key"], t.get("value", ""), t["effect"]) for t in d.get("taints") or []]
        for s in json.loads(response.data)["items"]
        for d in s["spec"].get("devices") or []
    }


def test_injected_xid_taints_the_gpu_until_it_has_been_healthy_for_the_period(
    cluster: ControlPlane,
    api: Any,
    namespace: str,
    node: SimulatedGpuNode,
    machine: MockMachine,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The plugin counts as registered once any of its slices exists; devices may follow.
    wait_for(lambda: "gpu-3" in published(api), what="gpu-3 published")
    machine.inject_xid(3, 79)  # 79: the GPU fell off the bus
    if target_minor() < 36:  # no device taints by default: withdrawn, then back
        wait_for(lambda: "gpu-3" not in published(api), what="gpu-3 withdrawn after Xid 79")
        assert {"gpu-0", "gpu-1"} <= published(api)
        wait_for(lambda: "gpu-3" in published(api), timeout_s=4 * RECOVERY_S, what="gpu-3 back")
        return
    lost = ("gpu.flexgpu.dev/gpu-lost", "xid-79", "NoSchedule")
    wait_for(lambda: taints(api).get("gpu-3") == [lost], what="gpu-3 tainted after Xid 79")
    assert taints(api)["gpu-0"] == [] and taints(api)["gpu-1"] == []
    # `flexgpu health` says which device and why.
    assert cli.main(["health", f"--kubeconfig={cluster.kubeconfig}", "-o", "json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["node"] == NODE]
    assert [(r["device"], r["effect"], r["reason"]) for r in rows] == [
        ("gpu-3", "NoSchedule", "GPU lost: Xid 79 (GPU has fallen off the bus)")
    ]
    # A new claim that can only have gpu-3 is not allocated while the taint is there...
    on_gpu_3 = f'device.attributes["{DRIVER}"].uuid == "{UUIDS[3]}"'
    create_claim(api, namespace, "on-3", {"requests": [gpu_request(cel=on_gpu_3)]})
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod("on-3", PRINT, {"g": {"resourceClaimName": "on-3"}}, NODE)
    )
    assert pending_reason(api, namespace, "on-3")
    assert allocated(api, namespace, "on-3") == []
    wait_for(
        lambda: taints(api).get("gpu-3") == [],
        timeout_s=4 * RECOVERY_S,
        what=f"gpu-3's taint cleared {RECOVERY_S}s after the last Xid",
    )
    # ...and is, once it has gone.
    wait_phase(api, namespace, "on-3", {"Running"}, timeout_s=90)
    release(api, namespace, "on-3")


def device_health_in_pod_status(api: Any, namespace: str, pod: str) -> dict[str, str]:
    """resourceID (the device's CDI id) -> health, from the pod's
    containerStatuses[].allocatedResourcesStatus (the kubelet's DRA manager fills it from the
    plugin's health stream)."""
    response = client.CoreV1Api(api).read_namespaced_pod(pod, namespace, _preload_content=False)
    statuses = json.loads(response.data).get("status", {}).get("containerStatuses") or []
    return {
        r["resourceID"]: r.get("health", "")
        for s in statuses
        for a in s.get("allocatedResourcesStatus") or []
        for r in a.get("resources") or []
    }


@pytest.mark.requires_k8s(
    "1.36", "device health in pod status (ResourceHealthStatus) is beta from 1.36"
)
def test_a_running_pods_status_shows_its_gpu_unhealthy_then_healthy_again(
    api: Any, namespace: str, node: SimulatedGpuNode, machine: MockMachine
) -> None:
    on_gpu_0 = f'device.attributes["{DRIVER}"].uuid == "{UUIDS[0]}"'
    run(api, namespace, node, "watched", {"requests": [gpu_request(cel=on_gpu_0)]})

    def gpu_0() -> str:
        health = device_health_in_pod_status(api, namespace, "watched")
        return next((h for r, h in health.items() if r.endswith("-gpu-0")), "")

    wait_for(
        lambda: gpu_0() == "Healthy",
        timeout_s=60,
        what="gpu-0 Healthy in the pod's status",
    )
    machine.inject_xid(0, 48)  # double-bit ECC error
    wait_for(
        lambda: gpu_0() == "Unhealthy",
        timeout_s=60,
        what="gpu-0 Unhealthy in the running pod's status after Xid 48",
    )
    assert client.CoreV1Api(api).read_namespaced_pod("watched", namespace).status.phase == (
        "Running"
    )
    wait_for(
        lambda: gpu_0() == "Healthy",
        timeout_s=4 * RECOVERY_S + 30,
        what="gpu-0 Healthy again after the healthy period",
    )
    release(api, namespace, "watched")


def test_a_lost_gpu_is_taken_out_at_once_and_the_other_gpus_stay_watched(
    api: Any, node: SimulatedGpuNode, machine: MockMachine
) -> None:
    quiet = [f"gpu-{i}" for i in (0, 1, 3)]
    wait_for(
        lambda: all(taints(api).get(name) == [] for name in quiet),
        timeout_s=4 * RECOVERY_S,
        what="the earlier tests' taints cleared",
    )
    machine.set_lost(1)
    # Nothing else reads the GPUs of a quiet node: NVML's event wait answering GPU_IS_LOST
    # is what finds it.
    if target_minor() < 36:  # no device taints by default: withdrawn, then back
        wait_for(lambda: "gpu-1" not in published(api), what="gpu-1 withdrawn once lost")
        machine.inject_xid(3, 48)
        wait_for(lambda: "gpu-3" not in published(api), what="gpu-3 withdrawn after Xid 48")
        machine.set_lost(1, False)
        wait_for(
            lambda: {"gpu-1", "gpu-3"} <= published(api),
            timeout_s=4 * RECOVERY_S,
            what="gpu-1 and gpu-3 back",
        )
        return
    lost = ("gpu.flexgpu.dev/gpu-lost", "lost", "NoSchedule")
    wait_for(lambda: taints(api).get("gpu-1") == [lost], what="gpu-1 tainted once lost")
    assert taints(api)["gpu-0"] == [] and taints(api)["gpu-3"] == []
    # The health loop blocks in its event wait again (on a set without GPU 1) instead of
    # asking a set that answers GPU_IS_LOST at once: the plugin stays near idle.
    assert node.plugin is not None and node.plugin.proc is not None
    pid, started, used = node.plugin.proc.pid, time.monotonic(), cpu_seconds(node.plugin.proc.pid)
    holds_for(
        lambda: cpu_seconds(pid) - used <= 0.5 + 0.3 * (time.monotonic() - started),
        5.0,
        "five 1 s event waits of the health loop; a spinning loop takes a whole core",
    )
    machine.inject_xid(3, 48)
    memory = ("gpu.flexgpu.dev/memory-error", "xid-48", "NoSchedule")
    wait_for(lambda: taints(api).get("gpu-3") == [memory], what="gpu-3 tainted after Xid 48")
    assert taints(api)["gpu-1"] == [lost]
    machine.set_lost(1, False)
    wait_for(
        lambda: taints(api).get("gpu-1") == [] and taints(api).get("gpu-3") == [],
        timeout_s=4 * RECOVERY_S,
        what=f"gpu-1 and gpu-3 clear {RECOVERY_S}s after GPU 1 is back and the last Xid",
    )
    # GPU 1 is watched again: its own Xid reaches the plugin.
    machine.inject_xid(1, 48)
    wait_for(lambda: taints(api).get("gpu-1") == [memory], what="gpu-1 tainted after Xid 48")
