"""The plugin never serves a node NVIDIA's device plugin serves, and does serve a node the
GPU Operator labelled for a device plugin it never ran: against the real API server, with
the plugin process on a simulated node whose Node carries the Operator's labels. The sign
of a device plugin is the Node's allocatable (the kubelet reports nvidia.com/gpu above 0
only while one is registered); here it is written into the Node's status as the kubelet
would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from flexgpu.kubelet_plugin.api.device_plugin_guard import CLEARED_REASON, WAITING_REASON
from tests.conftest import holds_for, wait_for
from tests.integration.conftest import running_gpu_node
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

NODE = "e2e-operator-node"
# What NVIDIA's GPU Operator sets on a GPU node (controllers/state_manager.go,
# gpuStateLabels for the container workload), its device plugin enabled or not, and the
# driver upgrade controller's state label.
OPERATOR_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.deploy.operands": "true",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
    "nvidia.com/gpu.deploy.container-toolkit": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.dcgm": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
    "nvidia.com/gpu.deploy.node-status-exporter": "true",
    "nvidia.com/gpu.deploy.operator-validator": "true",
    "nvidia.com/gpu-driver-upgrade-state": "upgrade-done",
}


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(
        cluster, api, NODE, "dgx-a100-8", plugin_args=("--device-plugin-recheck=1s",)
    ) as sim:
        yield sim


def _slices(api: Any) -> list[Any]:
    resources = client.ResourceV1Api(api)
    return list(resources.list_resource_slice(field_selector=f"spec.nodeName={NODE}").items)


def _events(api: Any, reason: str) -> list[str]:
    events = client.CoreV1Api(api).list_namespaced_event("default").items
    return [
        e.message
        for e in events
        if e.involved_object.name == NODE
        and e.involved_object.kind == "Node"
        and e.reason == reason
    ]


def _allocatable(api: Any, gpus: str) -> None:
    extended = {"nvidia.com/gpu": gpus}
    client.CoreV1Api(api).patch_node_status(
        NODE, {"status": {"capacity": extended, "allocatable": extended}}
    )


def test_an_operator_labelled_node_is_served_and_a_device_plugin_node_is_not(
    api: Any, node: SimulatedGpuNode
) -> None:
    """1. The Node has every label the Operator sets (device-plugin=true among them) and no
    device plugin: the plugin published (the fixture waited for its slices).
    2. Restarted while nvidia.com/gpu: 8 is allocatable, it registers nothing, publishes no
    slice and says why in a Warning Event, for as long as that lasts.
    3. Once the kubelet reports 0 (the device plugin went away) it starts, with a Normal
    Event, and publishes."""
    client.CoreV1Api(api).patch_node(NODE, {"metadata": {"labels": OPERATOR_LABELS}})
    assert _slices(api), "the plugin serves an Operator-labelled node without a device plugin"
    node.stop_plugin()
    client.ResourceV1Api(api).delete_collection_resource_slice(
        field_selector=f"spec.nodeName={NODE}"
    )
    _allocatable(api, "8")

    failed: list[BaseException] = []

    def start() -> None:
        try:
            node.start_plugin(timeout_s=120)
        except BaseException as error:
            failed.append(error)

    starter = threading.Thread(target=start)
    starter.start()
    wait_for(
        lambda: _events(api, WAITING_REASON),
        timeout_s=60,
        what="the DevicePluginServesNode Event",
        explain=lambda: node.plugin.log_tail(20) if node.plugin else "",
    )
    (message,) = _events(api, WAITING_REASON)
    assert "allocatable nvidia.com/gpu: 8" in message
    # Three re-reads of the Node at least (--device-plugin-recheck=1s).
    holds_for(
        lambda: not _slices(api) and "registered with the kubelet" not in node.plugin.log_tail(),  # type: ignore[union-attr]
        3.5,
        "about three re-reads of the Node",
    )
    assert len(_events(api, WAITING_REASON)) == 1, "one Event while nothing changes"

    _allocatable(api, "0")
    starter.join(150)
    assert not failed, failed
    assert node.registered()
    assert _events(api, CLEARED_REASON)
