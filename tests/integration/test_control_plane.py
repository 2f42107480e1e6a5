"""The local control plane is real: the upstream scheduler allocates DRA claims against
published ResourceSlices, and the resourceclaim controller manages generated claims."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

DRIVER = "gpu.flexgpu.dev"
IS_GPU = f'device.attributes["{DRIVER}"].type == "gpu"'


@pytest.fixture(autouse=True)
def remove_test_nodes(api: Any) -> Iterator[None]:
    """The hand-written slices here have no plugin behind them: later tests must not see them."""
    yield
    for node in ("sim-foundation-a", "sim-foundation-b"):
        with contextlib.suppress(client.ApiException):
            client.ResourceV1Api(api).delete_collection_resource_slice(
                field_selector=f"spec.nodeName={node}"
            )
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_node(node)


def _slice(node: str, devices: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-test"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": d,
                    "attributes": {
                        "type": {"string": "gpu"},
                        "productName": {"string": "NVIDIA H100 80GB HBM3"},
                    },
                    "capacity": {"memory": {"value": "81559Mi"}},
                }
                for d in devices
            ],
        },
    }


def _setup_class_and_slice(api: Any, node: str, devices: list[str]) -> None:
    resource = client.ResourceV1Api(api)
    create_simulated_node(api, node)
    try:
        resource.create_device_class(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": "foundation-test.gpu.flexgpu.dev"},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
            }
        )
    except client.ApiException as err:
        if err.status != 409:
            raise
    body = _slice(node, devices)
    body["metadata"]["name"] = f"{node}-test"
    try:
        resource.create_resource_slice(body)
    except client.ApiException as err:
        if err.status != 409:
            raise


def _pod_with_template(api: Any, namespace: str, name: str, node: str) -> None:
    resource = client.ResourceV1Api(api)
    resource.create_namespaced_resource_claim_template(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "one-gpu"},
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": "foundation-test.gpu.flexgpu.dev",
                                    "selectors": [{"cel": {"expression": IS_GPU}}],
                                },
                            }
                        ]
                    }
                }
            },
        },
    )
    client.CoreV1Api(api).create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [
                    {"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
            },
        },
    )


def _claim_of(api: Any, namespace: str, pod: str) -> Any:
    status = client.CoreV1Api(api).read_namespaced_pod(pod, namespace).status
    for entry in status.resource_claim_statuses or []:
        if entry.resource_claim_name:
            return client.ResourceV1Api(api).read_namespaced_resource_claim(
                entry.resource_claim_name, namespace
            )
    return None


@pytest.mark.requires_k8s("1.37", why="checks the default build, v1.37 from tools/k8s/go.mod")
def test_built_binaries_report_v1_37(cluster: ControlPlane) -> None:
    assert cluster.version.startswith("Kubernetes v1.37."), cluster.version
    assert "DRAPartitionableDevices=true" in cluster.feature_gates
    assert "DRAConsumableCapacity=true" in cluster.feature_gates


def test_scheduler_allocates_claim_from_published_slice(api: Any, namespace: str) -> None:
    node = "sim-foundation-a"
    _setup_class_and_slice(api, node, ["gpu-0", "gpu-1"])
    _pod_with_template(api, namespace, "needs-gpu", node)

    core = client.CoreV1Api(api)
    pod = wait_for(
        lambda: (p := core.read_namespaced_pod("needs-gpu", namespace)).spec.node_name and p,
        what="pod bound to a node",
    )
    assert pod.spec.node_name == node
    claim = wait_for(
        lambda: (
            (c := _claim_of(api, namespace, "needs-gpu")) and c.status and c.status.allocation and c
        ),
        what="generated claim allocated",
    )
    results = claim.status.allocation.devices.results
    assert len(results) == 1
    assert results[0].driver == DRIVER
    assert results[0].pool == node
    assert results[0].device in {"gpu-0", "gpu-1"}
    assert results[0].request == "gpu"
    reserved = [r.name for r in claim.status.reserved_for]
    assert reserved == ["needs-gpu"]


def test_resourceclaim_controller_deletes_generated_claim_with_pod(
    api: Any, namespace: str
) -> None:
    node = "sim-foundation-b"
    _setup_class_and_slice(api, node, ["gpu-0"])
    _pod_with_template(api, namespace, "short-lived", node)
    claim = wait_for(
        lambda: (
            (c := _claim_of(api, namespace, "short-lived"))
            and c.status
            and c.status.allocation
            and c
        ),
        what="generated claim allocated",
    )
    owners = [o.name for o in claim.metadata.owner_references]
    assert owners == ["short-lived"]

    core = client.CoreV1Api(api)
    # No kubelet runs the pod, so force-delete it as a kubelet would after it stopped.
    core.delete_namespaced_pod("short-lived", namespace, grace_period_seconds=0)
    resource = client.ResourceV1Api(api)

    def claim_gone() -> bool:
        try:
            resource.read_namespaced_resource_claim(claim.metadata.name, namespace)
        except client.ApiException as err:
            return err.status == 404
        return False

    wait_for(claim_gone, timeout_s=60, what="generated claim deleted by the controllers")
