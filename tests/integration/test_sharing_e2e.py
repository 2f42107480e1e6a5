"""GPU sharing end to end with the real scheduler and the upstream kubelet code: fractions of
shared H100s packed by consumable capacity and enforced with MPS limits; time-slicing and MPS
on whole GPUs, including the MPS daemon across a plugin restart."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    allocated,
    create_claim,
    env_from_log,
    granted,
    granted_uuids,
    make_pod,
    pending_reason,
    wait_container_output,
    wait_gone,
    wait_phase,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

NODE = "e2e-shared"
API = "gpu.flexgpu.dev/v1alpha1"
PRINT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_|CUDA_MPS)' | sort; echo DONE; sleep 120"
H100_MIB = 81559


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(
        cluster, api, NODE, "hgx-h100-8", plugin_args=("--shared-gpus=0,1",)
    ) as sim:
        yield sim


def share_request(memory: str | None = None, compute: str | None = None) -> dict[str, Any]:
    requests = {k: v for k, v in (("memory", memory), ("compute", compute)) if v}
    exactly: dict[str, Any] = {"deviceClassName": "shared-gpu.flexgpu.dev"}
    if requests:
        exactly["capacity"] = {"requests": requests}
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def run_share(
    api: Any,
    namespace: str,
    node: SimulatedGpuNode,
    name: str,
    memory: str | None = None,
    compute: str | None = None,
) -> dict[str, str]:
    create_claim(api, namespace, name, share_request(memory, compute))
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
    )
    wait_phase(api, namespace, name, {"Running"})
    return env_from_log(wait_container_output(node, namespace, name, "DONE"))


@pytest.mark.core
@pytest.mark.requires_k8s(
    "1.35",
    why="measured on 1.34.12: its alpha consumable-capacity allocator leaves the last "
    "fraction unschedulable (cannot allocate all claims) on a GPU with room for it",
)
def test_fractions_pack_onto_one_gpu_and_are_enforced(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    envs = {f"s{i}": run_share(api, namespace, node, f"s{i}", memory="16Gi") for i in range(5)}
    placed = {name: allocated(api, namespace, name)[0] for name in envs}
    assert [placed[f"s{i}"].device for i in range(4)] == ["gpu-0"] * 4
    assert placed["s4"].device == "gpu-1"  # 4 x 16Gi leave 15.6Gi of 79.6Gi on gpu-0
    assert len({p.share_id for p in placed.values()}) == 5
    for env in envs.values():
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=16384M"
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(-(-16384 * 100 // H100_MIB))
    pipes = {env["CUDA_MPS_PIPE_DIRECTORY"] for env in envs.values()}
    assert len(pipes) == 2  # one MPS daemon per GPU

    # More than one GPU's memory never fits; 70Gi does not fit until a share is released.
    for name, memory in (("huge", "100Gi"), ("big", "70Gi")):
        create_claim(api, namespace, name, share_request(memory))
        client.CoreV1Api(api).create_namespaced_pod(
            namespace, make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
        )
    assert "cannot allocate all claims" in pending_reason(api, namespace, "big")
    client.CoreV1Api(api).delete_namespaced_pod("s4", namespace)
    wait_gone(api, namespace, "s4")
    client.ResourceV1Api(api).delete_namespaced_resource_claim("s4", namespace)
    wait_phase(api, namespace, "big", {"Running"}, timeout_s=90)
    assert allocated(api, namespace, "big")[0].device == "gpu-1"
    assert "cannot allocate all claims" in pending_reason(api, namespace, "huge")


def test_compute_request_reserves_sms(api: Any, namespace: str, node: SimulatedGpuNode) -> None:
    env = run_share(api, namespace, node, "c30", memory="8Gi", compute="30")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert allocated(api, namespace, "c30")[0].consumed_capacity == {
        "memory": "8Gi",
        "compute": "30",
        "multiprocessors": "0",  # published for CEL on every device kind, never consumed
    }


def _gpu0_holders(api: Any) -> list[str]:
    """Claims of any namespace (earlier tests' included, until their namespace is gone)
    allocated gpu-0 of this node."""
    claims = client.ResourceV1Api(api).list_resource_claim_for_all_namespaces().items
    return [
        f"{c.metadata.namespace}/{c.metadata.name}"
        for c in claims
        if c.status and c.status.allocation
        for r in c.status.allocation.devices.results or []
        if (r.pool, r.device) == (NODE, "gpu-0")
    ]


def burstable_claim(name: str, compute: str, limit: int) -> dict[str, Any]:
    """A share of gpu-0 (pinned by CEL) reserving ``compute`` and limited to ``limit``."""
    devices = share_request("4Gi", compute)
    index = 'device.attributes["gpu.flexgpu.dev"].index == 0'
    devices["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": index}}]
    parameters = {"apiVersion": API, "kind": "GpuConfig", "share": {"computeLimit": limit}}
    devices["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": "gpu.flexgpu.dev", "parameters": parameters}}
    ]
    return devices


def test_burstable_fractions_get_their_limit_and_are_packed_by_their_request(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    """Two fractions reserving 40% and 60% with limits of 90% each share gpu-0 (counted by
    request, their limits add up to 180), each container gets its limit, the claims consume
    their requests, and a third fraction of 1% no longer fits on gpu-0."""
    wait_for(lambda: not _gpu0_holders(api), timeout_s=90, what="gpu-0 free of earlier claims")
    core = client.CoreV1Api(api)
    envs = {}
    for name, compute in (("b40", "40"), ("b60", "60")):
        create_claim(api, namespace, name, burstable_claim(name, compute, 90))
        pod = make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
        core.create_namespaced_pod(namespace, pod)
    for name, compute in (("b40", "40"), ("b60", "60")):
        wait_phase(api, namespace, name, {"Running"})
        envs[name] = env_from_log(wait_container_output(node, namespace, name, "DONE"))
        (result,) = allocated(api, namespace, name)
        assert result.device == "gpu-0"
        assert result.consumed_capacity == {
            "memory": "4Gi",
            "compute": compute,
            "multiprocessors": "0",
        }
    for env in envs.values():
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "90"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"  # memory stays the request
    assert envs["b40"]["CUDA_MPS_PIPE_DIRECTORY"] == envs["b60"]["CUDA_MPS_PIPE_DIRECTORY"]

    create_claim(api, namespace, "b1", burstable_claim("b1", "1", 100))
    core.create_namespaced_pod(
        namespace, make_pod("b1", PRINT, {"g": {"resourceClaimName": "b1"}}, NODE)
    )
    assert "cannot allocate all claims" in pending_reason(api, namespace, "b1")


def test_time_sliced_claim_shared_by_two_pods(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    create_claim(
        api,
        namespace,
        "ts",
        {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.flexgpu.dev"}}],
            "config": [
                {
                    "requests": ["gpu"],
                    "opaque": {
                        "driver": "gpu.flexgpu.dev",
                        "parameters": {
                            "apiVersion": API,
                            "kind": "GpuConfig",
                            "sharing": {
                                "strategy": "TimeSlicing",
                                "timeSlicingConfig": {"interval": "Short"},
                            },
                        },
                    },
                }
            ],
        },
    )
    ref = {"g": {"resourceClaimName": "ts"}}
    core = client.CoreV1Api(api)
    for pod in ("ts-a", "ts-b"):
        core.create_namespaced_pod(namespace, make_pod(pod, PRINT, ref, NODE))
    envs = [
        env_from_log(wait_container_output(node, namespace, p, "DONE")) for p in ("ts-a", "ts-b")
    ]
    assert granted_uuids(envs[0]) == granted_uuids(envs[1])
    assert granted(envs[0])[0]["timeSlice"] == "Short"


def test_mps_claim_keeps_its_daemon_across_a_plugin_restart(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    create_claim(
        api,
        namespace,
        "mps",
        {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.flexgpu.dev"}}],
            "config": [
                {
                    "opaque": {
                        "driver": "gpu.flexgpu.dev",
                        "parameters": {
                            "apiVersion": API,
                            "kind": "GpuConfig",
                            "sharing": {
                                "strategy": "MPS",
                                "mpsConfig": {
                                    "defaultActiveThreadPercentage": 40,
                                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                                },
                            },
                        },
                    }
                }
            ],
        },
    )
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace, make_pod("m1", PRINT, {"g": {"resourceClaimName": "mps"}}, NODE)
    )
    first = env_from_log(wait_container_output(node, namespace, "m1", "DONE"))
    assert first["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert first["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"

    node.stop_plugin()
    node.start_plugin()
    assert node.plugin is not None
    plugin = node.plugin
    # Registration comes before start-up reconcile: wait for its summary.
    wait_for(lambda: "stopped 0 MPS daemon(s)" in plugin.log_tail(50), what="reconcile summary")
    core.create_namespaced_pod(
        namespace, make_pod("m2", PRINT, {"g": {"resourceClaimName": "mps"}}, NODE)
    )
    second = env_from_log(wait_container_output(node, namespace, "m2", "DONE"))
    assert second["CUDA_MPS_PIPE_DIRECTORY"] == first["CUDA_MPS_PIPE_DIRECTORY"]
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    gpu = state["gpus"][int(granted(first)[0]["device"].removeprefix("gpu-"))]
    assert gpu["mps_running"] and gpu["mps_starts"] == 1  # adopted, never started twice
