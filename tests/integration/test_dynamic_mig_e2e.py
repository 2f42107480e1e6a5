"""On-demand MIG end to end: the real scheduler allocates partitions from counters the plugin
publishes, prepare creates each instance at exactly the allocated placement, unprepare
destroys it, and a whole GPU and its partitions exclude each other."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    allocated,
    create_claim,
    device_uuid,
    env_from_log,
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

NODE = "e2e-mig"
PRINT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_)' | sort; echo DONE; sleep 120"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(
        cluster, api, NODE, "hgx-h100-8", plugin_args=("--dynamic-mig-gpus=0,1,2",)
    ) as sim:
        yield sim


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


def instances(node: SimulatedGpuNode) -> dict[int, list[dict[str, Any]]]:
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return {i: g["mig_instances"] for i, g in enumerate(state["gpus"])}


def start(api: Any, namespace: str, name: str, devices: dict[str, Any]) -> None:
    create_claim(api, namespace, name, devices)
    client.CoreV1Api(api).create_namespaced_pod(
        namespace, make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
    )


def release(api: Any, namespace: str, name: str) -> None:
    client.CoreV1Api(api).delete_namespaced_pod(name, namespace)
    wait_gone(api, namespace, name)
    client.ResourceV1Api(api).delete_namespaced_resource_claim(name, namespace)


@pytest.mark.core
@pytest.mark.requires_k8s(
    "1.35",
    why="measured on 1.34.12: its alpha partitionable-devices allocator, with the shared "
    "counters beside their devices, picks other MIG placements than the ones asked for",
)
def test_partitions_are_created_on_demand_and_exclude_the_whole_gpu(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    small = [f"small{i}" for i in range(7)]
    for name in small:
        start(api, namespace, name, mig_request("1g.10gb"))
    for name in small:
        wait_phase(api, namespace, name, {"Running"})
    results = {n: allocated(api, namespace, n)[0] for n in small}
    assert sorted(r.device for r in results.values()) == [f"gpu-0-mig-1g10gb-{i}" for i in range(7)]
    created = {i["start"]: i for i in instances(node)[0]}
    assert sorted(created) == list(range(7))
    for name, result in results.items():
        env = env_from_log(wait_container_output(node, namespace, name, "DONE"))
        start_slice = int(result.device.rsplit("-", 1)[1])
        assert granted_uuids(env) == [created[start_slice]["uuid"]]
        assert granted_uuids(env)[0].startswith("MIG-")

    start(api, namespace, "medium", mig_request("3g.40gb"))
    wait_phase(api, namespace, "medium", {"Running"})
    assert allocated(api, namespace, "medium")[0].device == "gpu-1-mig-3g40gb-0"
    assert [(i["start"], i["size"]) for i in instances(node)[1]] == [(0, 4)]

    whole_gpu0 = {
        "requests": [
            {
                "name": "gpu",
                "exactly": {
                    "deviceClassName": "gpu.flexgpu.dev",
                    "selectors": [
                        {"cel": {"expression": f'device.attributes["{DRIVER}"].index == 0'}}
                    ],
                },
            }
        ]
    }
    start(api, namespace, "whole", whole_gpu0)
    assert "cannot allocate all claims" in pending_reason(api, namespace, "whole")

    for name in small:
        release(api, namespace, name)
    # The pending whole-GPU claim is allocated as soon as the partitions are released, so
    # by now gpu-0 may already hold it; none of the seven 1g instances may remain.
    assert [i for i in instances(node)[0] if i["size"] == 1] == []
    wait_phase(api, namespace, "whole", {"Running"}, timeout_s=90)
    assert allocated(api, namespace, "whole")[0].device == "gpu-0"
    # The whole GPU is the GPU itself: MIG mode switched off (which fails while any
    # instance is left), its GPU UUID handed out, never a MIG device.
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    assert instances(node)[0] == [] and state["gpus"][0]["mig_enabled"] is False
    whole = env_from_log(wait_container_output(node, namespace, "whole", "DONE"))
    assert granted_uuids(whole) == [device_uuid(api, NODE, "gpu-0")]
    assert granted_uuids(whole)[0].startswith("GPU-")


def test_crash_after_creating_an_instance_leaves_no_orphan(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    node.stop_plugin()
    node.plugin_env = {**_env(), "FLEXGPU_FAULT_CRASH_AT": "after-devices-created"}
    node.start_plugin()
    before = {i: list(v) for i, v in instances(node).items()}
    start(api, namespace, "crashy", mig_request("2g.20gb"))
    assert node.plugin is not None
    crashed = node.plugin
    crashed.proc.wait(60)  # type: ignore[union-attr]
    assert crashed.exit_code() == -signal.SIGKILL
    leftover = [i for g, v in instances(node).items() for i in v if i not in before[g]]
    assert len(leftover) == 1  # created, never recorded as Prepared

    node.plugin_env = None
    node.start_plugin()
    wait_phase(api, namespace, "crashy", {"Running"}, timeout_s=90)
    result = allocated(api, namespace, "crashy")[0]
    gpu = int(result.device.split("-")[1])
    env = env_from_log(wait_container_output(node, namespace, "crashy", "DONE"))
    now = [i for i in instances(node)[gpu] if i not in before[gpu]]
    assert [i["uuid"] for i in now] == granted_uuids(env)  # only the retry's
    release(api, namespace, "crashy")
    # Nothing this test created remains (the previous test's pods may still be going away,
    # so what was there before can only shrink).
    known = {i["uuid"] for v in before.values() for i in v}
    assert {i["uuid"] for v in instances(node).values() for i in v} <= known
    assert leftover[0]["uuid"] not in known


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
