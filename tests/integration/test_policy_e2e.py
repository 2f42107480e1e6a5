"""Static MIG from a GpuNodePolicy on a live node: idle GPUs are repartitioned at once, a
busy one is kept off the scheduler (tainted) and left untouched, with the reason in the
policy's status, and follows as soon as its pod is gone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.names import CRD_GROUP
from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    allocated,
    create_claim,
    env_from_log,
    granted_uuids,
    make_pod,
    wait_container_output,
    wait_gone,
    wait_phase,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

NODE = "e2e-policy"
PRINT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_)' | sort; echo DONE; sleep 120"


@pytest.fixture
def node(cluster: ControlPlane, api: Any, crd_installed: None) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(cluster, api, NODE, "hgx-h100-8") as sim:
        client.CoreV1Api(api).patch_node(NODE, {"metadata": {"labels": {"flexgpu.dev/pool": "p"}}})
        yield sim


def node_status(api: Any, policy: str) -> dict[str, Any]:
    obj: Any = client.CustomObjectsApi(api).get_cluster_custom_object(
        CRD_GROUP, "v1alpha1", "gpunodepolicies", policy
    )
    return dict((obj.get("status") or {}).get("nodes", {}).get(NODE, {}))


def devices(api: Any) -> dict[str, Any]:
    found = {}
    for s in (
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}")
        .items
    ):
        for d in s.spec.devices or []:
            found[d.name] = d
    return found


@pytest.mark.core
def test_layout_change_waits_for_the_busy_gpu_only(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    index0 = f'device.attributes["{DRIVER}"].index == 0'
    create_claim(
        api,
        namespace,
        "busy",
        {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {
                        "deviceClassName": "gpu.flexgpu.dev",
                        "selectors": [{"cel": {"expression": index0}}],
                    },
                }
            ]
        },
    )
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace, make_pod("busy", PRINT, {"g": {"resourceClaimName": "busy"}}, NODE)
    )
    wait_phase(api, namespace, "busy", {"Running"})

    custom = client.CustomObjectsApi(api)
    custom.create_cluster_custom_object(
        CRD_GROUP,
        "v1alpha1",
        "gpunodepolicies",
        {
            "apiVersion": "flexgpu.dev/v1alpha1",
            "kind": "GpuNodePolicy",
            "metadata": {"name": "split-two"},
            "spec": {
                "nodeSelector": {"matchLabels": {"flexgpu.dev/pool": "p"}},
                "gpus": [
                    {"selector": {"indices": [0, 1]}, "mode": "MIG", "migLayout": {"3g.40gb": 2}}
                ],
            },
        },
    )
    try:
        status = wait_for(
            lambda: (
                (s := node_status(api, "split-two")).get("gpus", {}).get("1", {}).get("reason")
                == "Applied"
                and s
            ),
            timeout_s=60,
            what="GPU 1 repartitioned",
        )
        assert status["gpus"]["1"]["migLayout"] == {"3g.40gb": 2}
        assert status["gpus"]["0"]["reason"] == "Pending"
        assert f"{namespace}/busy" in status["gpus"]["0"]["message"]
        applied = {c["type"]: c for c in status["conditions"]}["Applied"]
        assert applied["status"] == "False" and applied["reason"] == "Pending"

        published = wait_for(
            lambda: (d := devices(api)).get("gpu-1-mig-3g40gb-4") and d,
            what="GPU 1's new MIG devices published",
        )
        assert "gpu-1-mig-3g40gb-0" in published and "gpu-1" not in published
        assert [t.key for t in published["gpu-0"].taints] == ["flexgpu.dev/reconfiguring"]
        assert not published["gpu-2"].taints  # other GPUs keep serving

        # The new partitions are usable right away.
        create_claim(
            api,
            namespace,
            "part",
            {"requests": [{"name": "mig", "exactly": {"deviceClassName": "mig.flexgpu.dev"}}]},
        )
        core.create_namespaced_pod(
            namespace, make_pod("part", PRINT, {"g": {"resourceClaimName": "part"}}, NODE)
        )
        wait_phase(api, namespace, "part", {"Running"})
        result = allocated(api, namespace, "part")[0]
        assert result.device.startswith("gpu-1-mig-3g40gb-")
        env = env_from_log(wait_container_output(node, namespace, "part", "DONE"))
        assert granted_uuids(env) == [published[result.device].attributes["uuid"].string]

        core.delete_namespaced_pod("busy", namespace)
        wait_gone(api, namespace, "busy")
        wait_for(
            lambda: node_status(api, "split-two")["gpus"]["0"]["reason"] == "Applied",
            timeout_s=60,
            what="GPU 0 repartitioned once idle",
        )
        after = wait_for(
            lambda: (d := devices(api)).get("gpu-0-mig-3g40gb-0") and d,
            what="GPU 0's MIG devices published",
        )
        assert "gpu-0" not in after and not after["gpu-0-mig-3g40gb-0"].taints
        applied = {c["type"]: c for c in node_status(api, "split-two")["conditions"]}["Applied"]
        assert applied["status"] == "True"
    finally:
        custom.delete_cluster_custom_object(CRD_GROUP, "v1alpha1", "gpunodepolicies", "split-two")


def test_layout_that_does_not_fit_is_refused_in_status(api: Any, node: SimulatedGpuNode) -> None:
    custom = client.CustomObjectsApi(api)
    custom.create_cluster_custom_object(
        CRD_GROUP,
        "v1alpha1",
        "gpunodepolicies",
        {
            "apiVersion": "flexgpu.dev/v1alpha1",
            "kind": "GpuNodePolicy",
            "metadata": {"name": "unsupported"},
            "spec": {
                "nodeSelector": {"matchLabels": {"flexgpu.dev/pool": "p"}},
                "gpus": [
                    {"selector": {"indices": [3]}, "mode": "MIG", "migLayout": {"2g.35gb": 1}}
                ],
            },
        },
    )
    try:
        status = wait_for(
            lambda: (s := node_status(api, "unsupported")).get("gpus") and s,
            timeout_s=60,
            what="status for the refused layout",
        )
        gpu = status["gpus"]["3"]
        assert gpu["reason"] == "Unsupported"
        assert 'profile "2g.35gb" is not offered by NVIDIA H100 80GB HBM3' in gpu["message"]
        assert "gpu-3" in devices(api)  # left as it was
    finally:
        custom.delete_cluster_custom_object(CRD_GROUP, "v1alpha1", "gpunodepolicies", "unsupported")
