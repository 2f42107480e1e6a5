"""What the plugin costs the API server: prepare+unprepare cycles through its real DRA socket
against the real apiserver, counted by the apiserver itself (``apiserver_request_total``).
Each prepare reads its claim once; status writes of a claim prepared and unprepared within
the writer's window fold away; unprepares do not make the node policy agent read anything."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.grpc_stubs.dra.v1 import dra_pb2_grpc
from tests.conftest import wait_for
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import DRIVER
from tools.cluster.nodes import create_simulated_node
from tools.cluster.process import Component

pytestmark = pytest.mark.integration

NODE = "traffic-node"
CYCLES = 60
# What the plugin reads or writes; other components' traffic on these (the controller
# manager patching the Node's conditions) is left out by verb below.
RESOURCES = {"resourceclaims", "resourceslices", "gpunodepolicies", "nodes", "events"}
_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def request_counts(admin: KubeApi) -> Counter[tuple[str, str, str]]:
    """(verb, resource, subresource) -> requests served so far."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for line in admin.request_bytes("GET", "/metrics").decode().splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        counts[key] += int(float(match["value"]))
    return counts


def plugin_requests(before: Counter[Any], after: Counter[Any]) -> Counter[Any]:
    delta = after - before
    return Counter(
        {
            key: n
            for key, n in delta.items()
            if key[1] in RESOURCES and not (key[1] == "nodes" and key[0] in ("PATCH", "PUT"))
        }
    )


def allocated_claim(api: Any, namespace: str, name: str, device: str) -> str:
    resource = client.ResourceV1Api(api)
    created = resource.create_namespaced_resource_claim(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
            },
        },
    )
    body = api.sanitize_for_serialization(created)
    body["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        }
    }
    resource.replace_namespaced_resource_claim_status(name, namespace, body)
    return str(created.metadata.uid)


@pytest.fixture
def plugin(cluster: ControlPlane, api: Any, crd_installed: None) -> Iterator[Component]:
    """The plugin with 8 simulated H100s; its DRA socket is under ``<log dir>/plugins``."""
    create_simulated_node(api, NODE)
    root = Path(tempfile.mkdtemp(prefix="fgt-", dir="/tmp"))
    component = Component(
        "plugin",
        [
            sys.executable,
            "-m",
            "flexgpu.kubelet_plugin.main",
            "--gpu-backend=simulated",
            "--topology=hgx-h100-8",
            f"--node-name={NODE}",
            f"--kubeconfig={cluster.kubeconfig}",
            f"--registry-dir={root}/reg",
            f"--plugins-dir={root}/plugins",
            f"--cdi-dir={root}/cdi",
            f"--data-dir={root}/data",
        ],
        root / "plugin.log",
    )
    component.start()
    try:
        yield component
    finally:
        component.stop()
        with_slices = client.ResourceV1Api(api)
        with_slices.delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
        client.CoreV1Api(api).delete_node(NODE)
        shutil.rmtree(root, ignore_errors=True)


def test_prepare_unprepare_cycle_costs_at_most_one_and_a_half_requests(
    cluster: ControlPlane, api: Any, namespace: str, plugin: Component
) -> None:
    admin = KubeApi.from_kubeconfig(cluster.kubeconfig)
    claims = [
        # GPUs 6 and 7 of hgx-h100-8 are in MIG mode: not whole GPUs.
        (f"c{i}", allocated_claim(api, namespace, f"c{i}", f"gpu-{i % 6}"))
        for i in range(CYCLES + 1)
    ]
    socket = plugin.log_path.parent / "plugins" / DRIVER / "dra.sock"
    wait_for(socket.exists, what="the DRA socket")
    resource = client.ResourceV1Api(api)
    wait_for(
        lambda: resource.list_resource_slice(field_selector=f"spec.nodeName={NODE}").items,
        what="the plugin's slices",
    )
    # Its policy agent has listed policies and its Node (then watches them).
    wait_for(
        lambda: "node policy agent: watching" in plugin.log_tail(200),
        what="the policy agent's first lists",
    )
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = dra_pb2_grpc.DRAPluginStub(channel)

        def cycle(name: str, uid: str) -> None:
            ref = dra_pb2.Claim(namespace=namespace, name=name, uid=uid)
            reply = stub.NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert reply.claims[uid].error == ""
            assert [d.device_name for d in reply.claims[uid].devices]
            done = stub.NodeUnprepareResources(
                dra_pb2.NodeUnprepareResourcesRequest(claims=[ref]), timeout=30
            )
            assert done.claims[uid].error == ""

        cycle(*claims[0])  # warm-up: connections, first checkpoint
        before = request_counts(admin)
        for name, uid in claims[1:]:
            cycle(name, uid)
    # Stopping flushes every pending status write and ends the watches, so all the
    # plugin's requests of the run are counted.
    plugin.stop()
    assert plugin.exit_code() == 0
    spent = plugin_requests(before, request_counts(admin))
    per_cycle = sum(spent.values()) / CYCLES
    print(f"{per_cycle:.2f} apiserver requests per prepare+unprepare cycle: {dict(spent)}")
    assert per_cycle <= 1.5, f"{per_cycle:.2f} requests per cycle: {dict(spent)}"
    assert spent[("GET", "resourceclaims", "")] >= CYCLES  # each prepare read its claim
    assert spent[("LIST", "gpunodepolicies", "")] == 0 and spent[("GET", "nodes", "")] == 0
    for name, _ in claims:
        status = resource.read_namespaced_resource_claim(name, namespace).status
        assert not status.devices  # nothing left behind by the folded writes
