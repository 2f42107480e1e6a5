"""End to end: the real scheduler allocates from what the plugin publishes, the upstream kubelet
code (harness) prepares through the plugin's sockets, and each container sees exactly the GPUs
it was given; after the pod, the claim is unprepared and its CDI spec is gone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    allocated,
    cdi_specs,
    checkpoint_claims,
    create_claim,
    device_uuid,
    env_from_log,
    gpu_request,
    granted,
    granted_claim_uid,
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

H100_NODE, L4_NODE = "e2e-h100", "e2e-l4"
PRINT_ENV = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_)' | sort; echo DONE; sleep 60"


@pytest.fixture(scope="module")
def nodes(cluster: ControlPlane, api: Any) -> Iterator[dict[str, SimulatedGpuNode]]:
    with contextlib.ExitStack() as stack:
        yield {
            name: stack.enter_context(running_gpu_node(cluster, api, name, topology))
            for name, topology in ((H100_NODE, "hgx-h100-8"), (L4_NODE, "l4-2-pcie"))
        }


def _run(api: Any, namespace: str, node: SimulatedGpuNode, pod: dict[str, Any]) -> dict[str, str]:
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    name = pod["metadata"]["name"]
    wait_phase(api, namespace, name, {"Running"})
    return env_from_log(wait_container_output(node, namespace, name, "DONE"))


def _delete_and_check_unprepared(
    api: Any, namespace: str, node: SimulatedGpuNode, pod: str, claim_uid: str
) -> None:
    client.CoreV1Api(api).delete_namespaced_pod(pod, namespace)
    wait_gone(api, namespace, pod)
    assert claim_uid not in checkpoint_claims(node)
    assert not [s for s in cdi_specs(node) if claim_uid in s]


@pytest.mark.core
def test_one_gpu(api: Any, namespace: str, nodes: dict[str, SimulatedGpuNode]) -> None:
    node = nodes[H100_NODE]
    create_claim(api, namespace, "one", {"requests": [gpu_request()]})
    env = _run(
        api,
        namespace,
        node,
        make_pod("one", PRINT_ENV, {"g": {"resourceClaimName": "one"}}, H100_NODE),
    )
    (result,) = allocated(api, namespace, "one")
    (got,) = granted(env)
    assert got["uuid"] == device_uuid(api, H100_NODE, result.device)
    assert got["claim"] == f"{namespace}/one" and got["device"] == result.device
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # no runtime hook adds GPUs of its own
    uid = got["claimUID"]
    assert checkpoint_claims(node)[uid]["state"] == "Prepared"
    assert [s for s in cdi_specs(node) if uid in s]
    # The claim's status tells the user what they got.
    resource = client.ResourceV1Api(api)
    status = wait_for(
        lambda: resource.read_namespaced_resource_claim("one", namespace).status.devices,
        what="status.devices written by the plugin",
    )
    assert [(d.driver, d.pool, d.device) for d in status] == [(DRIVER, H100_NODE, result.device)]
    assert status[0].data == {
        "uuid": got["uuid"],
        "productName": "NVIDIA H100 80GB HBM3",
    }
    assert [(c.type, c.status) for c in status[0].conditions] == [("Ready", "True")]
    client.CoreV1Api(api).delete_namespaced_pod("one", namespace)
    wait_gone(api, namespace, "one")
    wait_for(
        lambda: not resource.read_namespaced_resource_claim("one", namespace).status.devices,
        what="status.devices removed after unprepare",
    )
    assert uid not in checkpoint_claims(node)


PAIRS_NODE = "sim-nvlink-pairs"
PAIRS_TOPOLOGY = Path(__file__).parent / "topologies" / "h100-nvlink-pairs-4.yaml"


def _attribute(api: Any, pool: str, device: str, name: str) -> str:
    for s in (
        client.ResourceV1Api(api)
        .list_resource_slice(field_selector=f"spec.nodeName={pool},spec.driver={DRIVER}")
        .items
    ):
        for d in s.spec.devices or []:
            if d.name == device:
                return str(d.attributes[name].string)
    raise AssertionError(f"device {device} not published by {pool}")


def _hold(api: Any, namespace: str, node: SimulatedGpuNode, name: str, *indices: int) -> None:
    """A running pod holding the GPUs of ``indices`` on the pairs node."""
    index = f'device.attributes["{DRIVER}"].index'
    cel = " || ".join(f"{index} == {i}" for i in indices)
    create_claim(api, namespace, name, {"requests": [gpu_request(count=len(indices), cel=cel)]})
    _run(
        api,
        namespace,
        node,
        make_pod(name, PRINT_ENV, {"g": {"resourceClaimName": name}}, PAIRS_NODE),
    )


@pytest.mark.core
def test_two_gpus_of_one_nvlink_domain(cluster: ControlPlane, api: Any, namespace: str) -> None:
    """A node with two NVLink domains (pairs 0-1 and 2-3). While only GPUs 0 and 2 are free
    (two GPUs, but of different domains) a claim for two GPUs of one nvlinkDomain is not
    allocated (without the constraint it would get 0 and 2); once GPU 3 is freed it gets 2
    and 3, of one domain."""
    with running_gpu_node(cluster, api, PAIRS_NODE, str(PAIRS_TOPOLOGY)) as node:
        _hold(api, namespace, node, "hold-3", 3)
        _hold(api, namespace, node, "hold-1", 1)
        create_claim(
            api,
            namespace,
            "pair",
            {
                "requests": [gpu_request(count=2)],
                "constraints": [{"requests": ["gpu"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}],
            },
        )
        pod = make_pod("pair", PRINT_ENV, {"g": {"resourceClaimName": "pair"}}, PAIRS_NODE)
        client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
        # The scheduler's own verdict, not a wait to see that nothing happens.
        assert "claim" in pending_reason(api, namespace, "pair")
        assert allocated(api, namespace, "pair") == []
        client.CoreV1Api(api).delete_namespaced_pod("hold-3", namespace)
        wait_gone(api, namespace, "hold-3")
        client.ResourceV1Api(api).delete_namespaced_resource_claim("hold-3", namespace)
        wait_phase(api, namespace, "pair", {"Running"})
        env = env_from_log(wait_container_output(node, namespace, "pair", "DONE"))
        results = allocated(api, namespace, "pair")
        assert sorted(r.device for r in results) == ["gpu-2", "gpu-3"]
        domains = {_attribute(api, PAIRS_NODE, r.device, "nvlinkDomain") for r in results}
        assert len(domains) == 1
        assert domains != {_attribute(api, PAIRS_NODE, "gpu-0", "nvlinkDomain")}
        expected = {device_uuid(api, PAIRS_NODE, r.device) for r in results}
        assert set(granted_uuids(env)) == expected
        _delete_and_check_unprepared(api, namespace, node, "pair", granted_claim_uid(env))
        client.CoreV1Api(api).delete_namespaced_pod("hold-1", namespace)
        wait_gone(api, namespace, "hold-1")


def test_cel_product_name_selects_the_l4_node(
    api: Any, namespace: str, nodes: dict[str, SimulatedGpuNode]
) -> None:
    node = nodes[L4_NODE]
    cel = f'device.attributes["{DRIVER}"].productName == "NVIDIA L4"'
    create_claim(api, namespace, "l4", {"requests": [gpu_request(cel=cel)]})
    env = _run(api, namespace, node, make_pod("l4", PRINT_ENV, {"g": {"resourceClaimName": "l4"}}))
    pod = client.CoreV1Api(api).read_namespaced_pod("l4", namespace)
    assert pod.spec.node_name == L4_NODE
    (result,) = allocated(api, namespace, "l4")
    assert result.pool == L4_NODE
    assert granted_uuids(env) == [device_uuid(api, L4_NODE, result.device)]
    _delete_and_check_unprepared(api, namespace, node, "l4", granted_claim_uid(env))


def test_claim_shared_by_two_pods(
    api: Any, namespace: str, nodes: dict[str, SimulatedGpuNode]
) -> None:
    node = nodes[H100_NODE]
    create_claim(api, namespace, "shared", {"requests": [gpu_request()]})
    ref = {"g": {"resourceClaimName": "shared"}}
    first = _run(api, namespace, node, make_pod("first", PRINT_ENV, ref, H100_NODE))
    second = _run(api, namespace, node, make_pod("second", PRINT_ENV, ref, H100_NODE))
    assert granted_uuids(first) == granted_uuids(second)
    uid = granted_claim_uid(first)
    # The claim stays prepared while one pod still uses it.
    client.CoreV1Api(api).delete_namespaced_pod("first", namespace)
    wait_gone(api, namespace, "first")
    assert checkpoint_claims(node)[uid]["state"] == "Prepared"
    _delete_and_check_unprepared(api, namespace, node, "second", uid)
