"""The plugin's published slices pass the real apiserver's validation, come back when deleted
or edited behind its back, and the real scheduler allocates from them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import render_node_gpus
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from tests.conftest import wait_for
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

H100_UNDER_80GI = (
    f'device.attributes["{DRIVER_NAME}"].productName.startsWith("NVIDIA H100") && '
    f'device.capacity["{DRIVER_NAME}"].memory.compareTo(quantity("80Gi")) < 0'
)


def _our_slices(api: Any, node: str) -> list[Any]:
    return list(
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={node},spec.driver={DRIVER_NAME}")
        .items
    )


@pytest.fixture
def kube(cluster: ControlPlane) -> KubeApi:
    """The plugin's own client, as the publisher uses it in the plugin."""
    return KubeApi.from_kubeconfig(cluster.kubeconfig)


@pytest.fixture
def published(api: Any, kube: KubeApi, tmp_path: Path) -> Iterator[tuple[str, SlicePublisher]]:
    node = f"sim-pub-{tmp_path.name[-6:].lower().replace('_', '-')}"
    create_simulated_node(api, node, labels={"flexgpu.dev/test": "publisher"})
    backend = SimulatedBackend(load_topology("hgx-h100-8"), node, state_path=tmp_path / "s.json")
    publisher = SlicePublisher(kube, node, resync_interval_s=5)
    publisher.set_devices(render_node_gpus(backend.list_gpus()))
    publisher.start()
    yield node, publisher
    publisher.stop()
    publisher.delete_all()


def test_published_pool_is_accepted_and_owned_by_the_node(
    api: Any, published: tuple[str, SlicePublisher]
) -> None:
    node, _ = published
    slices = wait_for(lambda: _our_slices(api, node), what="slices created")
    assert len(slices) == 1
    spec = slices[0].spec
    assert spec.pool.name == node and spec.pool.resource_slice_count == 1
    assert [d.name for d in spec.devices] == [f"gpu-{i}" for i in range(8)]
    owner = slices[0].metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("Node", node, True)
    attrs = spec.devices[0].attributes
    assert attrs["productName"].string == "NVIDIA H100 80GB HBM3"
    assert attrs["resource.kubernetes.io/pcieRoot"].string == "pci0000:15"


def test_deleted_slice_comes_back(api: Any, published: tuple[str, SlicePublisher]) -> None:
    node, _ = published
    first = wait_for(lambda: _our_slices(api, node), what="slices created")[0]
    client.ResourceV1Api(api).delete_resource_slice(first.metadata.name)
    again = wait_for(
        lambda: [s for s in _our_slices(api, node) if s.metadata.uid != first.metadata.uid],
        timeout_s=20,
        what="slice re-created",
    )
    assert [d.name for d in again[0].spec.devices] == [f"gpu-{i}" for i in range(8)]


def test_edited_slice_is_repaired(api: Any, published: tuple[str, SlicePublisher]) -> None:
    node, _ = published
    current = wait_for(lambda: _our_slices(api, node), what="slices created")[0]
    body = client.ApiClient().sanitize_for_serialization(current)
    body["spec"]["devices"] = body["spec"]["devices"][:2]
    client.ResourceV1Api(api).replace_resource_slice(current.metadata.name, body)
    wait_for(
        lambda: (s := _our_slices(api, node)) and len(s[0].spec.devices) == 8,
        timeout_s=20,
        what="slice repaired to 8 devices",
    )


def test_a_content_change_of_the_one_slice_is_written_in_place(
    api: Any, published: tuple[str, SlicePublisher]
) -> None:
    """One slice changes: one atomic write, the pool's generation kept (upstream's
    resourceslice controller does the same); the scheduler reads the new content at once."""
    node, publisher = published
    first = wait_for(lambda: _our_slices(api, node), what="slices created")[0]
    devices = [d for d in _device_dicts(first) if d["name"] != "gpu-7"]
    publisher.set_devices(devices)
    updated = wait_for(
        lambda: (s := _our_slices(api, node)) and len(s[0].spec.devices) == 7 and s[0],
        what="slice updated to 7 devices",
    )
    assert updated.metadata.uid == first.metadata.uid
    assert updated.spec.pool.generation == first.spec.pool.generation


def test_publish_again_bumps_the_generation(
    api: Any, published: tuple[str, SlicePublisher]
) -> None:
    node, publisher = published
    first = wait_for(lambda: _our_slices(api, node), what="slices created")[0]
    publisher.publish_again()
    wait_for(
        lambda: (
            (s := _our_slices(api, node)) and s[0].spec.pool.generation > first.spec.pool.generation
        ),
        what="generation bumped",
    )


def _device_dicts(slice_obj: Any) -> list[dict[str, Any]]:
    data = client.ApiClient().sanitize_for_serialization(slice_obj)
    return list(data["spec"]["devices"])


def test_scheduler_allocates_by_product_name_from_published_slices(
    api: Any, namespace: str, published: tuple[str, SlicePublisher]
) -> None:
    node, _ = published
    wait_for(lambda: _our_slices(api, node), what="slices created")
    resource = client.ResourceV1Api(api)
    try:
        resource.create_device_class(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": "publisher-test.gpu.flexgpu.dev"},
                "spec": {
                    "selectors": [
                        {
                            "cel": {
                                "expression": f'device.driver == "{DRIVER_NAME}" && '
                                f'device.attributes["{DRIVER_NAME}"].type == "gpu"'
                            }
                        }
                    ]
                },
            }
        )
    except client.ApiException as err:
        if err.status != 409:
            raise
    resource.create_namespaced_resource_claim(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "two-h100"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {
                                "deviceClassName": "publisher-test.gpu.flexgpu.dev",
                                "count": 2,
                                "selectors": [{"cel": {"expression": H100_UNDER_80GI}}],
                            },
                        }
                    ],
                    "constraints": [
                        {"requests": ["gpus"], "matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}
                    ],
                }
            },
        },
    )
    client.CoreV1Api(api).create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [
                    {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
                ],
                "resourceClaims": [{"name": "g", "resourceClaimName": "two-h100"}],
            },
        },
    )
    claim = wait_for(
        lambda: (
            (c := resource.read_namespaced_resource_claim("two-h100", namespace)).status
            and c.status.allocation
            and c
        ),
        what="claim allocated",
    )
    results = claim.status.allocation.devices.results
    assert sorted(r.device for r in results) == ["gpu-0", "gpu-1"]
    assert {r.pool for r in results} == {node}


def test_published_content_is_stable_for_every_topology(
    api: Any, kube: KubeApi, tmp_path: Path
) -> None:
    """What the server stores (quantities canonicalised, defaults added) must count as what we
    wrote, or the publisher would rewrite its slices forever."""
    for topology in ("dgx-a100-8", "h200-4", "mixed", "l4-2-pcie"):
        node = f"sim-stable-{topology}"
        create_simulated_node(api, node)
        backend = SimulatedBackend(
            load_topology(topology), node, state_path=tmp_path / f"{topology}.json"
        )
        publisher = SlicePublisher(kube, node, resync_interval_s=5)
        publisher.set_devices(render_node_gpus(backend.list_gpus()))
        publisher.start()
        try:
            wait_for(lambda n=node: _our_slices(api, n), what=f"{topology} slices")
            # No waiting to see whether a rewrite follows: a pass now must find the server's
            # copy equal to ours and write nothing (a rewrite loop starts exactly there).
            assert publisher.reconcile_once() is False, f"{topology}: server copy differs"
            assert publisher.reconciles == 1, f"{topology}: rewritten {publisher.reconciles}x"
        finally:
            publisher.stop()
            publisher.delete_all()


def test_slices_return_within_5s_of_an_apiserver_restart(tmp_path: Path) -> None:
    """The apiserver is down for 18 s (long enough for an uncapped backoff to grow to 16 s),
    comes back, and a slice deleted right then is re-created within 5 s. Its own control plane:
    restarting the shared one would disturb the other tests."""
    with ControlPlane(workdir=tmp_path / "cluster") as plane:
        api = plane.api_client()
        node = "sim-restart"
        create_simulated_node(api, node)
        backend = SimulatedBackend(load_topology("l4-2-pcie"), node, state_path=tmp_path / "s.json")
        publisher = SlicePublisher(
            KubeApi.from_kubeconfig(plane.kubeconfig), node, resync_interval_s=30
        )
        publisher.set_devices(render_node_gpus(backend.list_gpus()))
        publisher.start()
        try:
            first = wait_for(lambda: _our_slices(api, node), what="slices created")[0]
            plane.restart_apiserver(down_s=18)
            # A fresh client: the old one's pooled connections died with the server.
            admin = plane.api_client()
            client.ResourceV1Api(admin).delete_resource_slice(first.metadata.name)
            deleted_at = time.monotonic()
            wait_for(
                lambda: [
                    s for s in _our_slices(admin, node) if s.metadata.uid != first.metadata.uid
                ],
                timeout_s=5,
                interval_s=0.05,
                what="slice re-created within 5 s of the restarted apiserver being ready",
            )
            print(f"slice back {time.monotonic() - deleted_at:.2f}s after the delete")
        finally:
            publisher.stop()
