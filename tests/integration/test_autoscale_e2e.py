"""Karpenter provisions flex GPU nodes for pending GPU claims and removes them when idle.

Karpenter v1.15 (its kwok cloud provider, DRA simulation on: ``IGNORE_DRA_REQUESTS=false``)
runs against the local control plane with one GPU instance type whose DynamicResources are
``flexgpu node-template``'s (HGX H100 x8: GPUs 0-3 whole, 4-5 shared, 6-7 on-demand MIG). Pods
with whole-GPU, NVLink-set, MIG-profile and fractional claims arrive that no node serves;
Karpenter launches nodes, and the test world plays each one (tools.autoscale.node_agent): a
simulated flexgpu plugin and the kubelet harness, so the node's real slices replace the
template and kube-scheduler, not Karpenter, places the pods. A mismatch between what Karpenter
expected and what the plugin published fails the test three ways: a node's slices differ from
the template (field by field, placeholders aside), a pod the launched nodes should serve stays
pending, or Karpenter launches more nodes than its first decision. Then the pods finish, the
GPUs go idle, and consolidation removes each node with its slices: first the node whose pods
finished while the other stays busy, then the last.

Karpenter's controller is a Go build of many minutes cold: ``make test`` builds it first
(``make karpenter``); run here without it, the test builds it on first use."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from flexgpu.controller.cli_node_template import binding_conditions
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.node_template import TemplatePolicy, render_node_template
from flexgpu.driver.template_check import current_pool, template_differences
from flexgpu.driver.topology import load_topology
from tests.conftest import wait_for
from tests.integration.gpu_workloads import ensure_device_classes
from tools.autoscale.karpenter import NODEPOOL_LABEL, GpuInstanceType, Karpenter
from tools.autoscale.node_agent import NodeAgent

pytestmark = pytest.mark.integration

NODEPOOL = "flexgpu-gpu"
INSTANCE_NAME = "gpu-h100-8x"


def instance_type(api: Any) -> GpuInstanceType:
    """The GPU instance type, its template as the plugin publishes it on this cluster's
    release (on-demand partitions carry binding conditions from 1.36, the plugin's default)."""
    version = client.VersionApi(api).get_code().git_version
    return GpuInstanceType(
        INSTANCE_NAME,
        "hgx-h100-8",
        TemplatePolicy(
            shared=frozenset({4, 5}),
            dynamic_mig=frozenset({6, 7}),
            binding_conditions=binding_conditions("auto", version),
        ),
    )


KARPENTER = "karpenter.sh"
KWOK = "karpenter.kwok.sh"


def cel(expression: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": expression}}]


def request(device_class: str, count: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": "r", "exactly": {"deviceClassName": device_class, "count": count, **extra}}


# Two NVLink sets of four cannot share a node (six GPUs serve whole there: 0-3 and the
# on-demand MIG GPUs 6-7), so the first decision is two nodes; the rest fits beside them.
WORKLOADS: dict[str, dict[str, Any]] = {
    "nvlink-a": {
        "requests": [request("gpu.flexgpu.dev", 4)],
        "constraints": [{"requests": ["r"], "matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}],
    },
    "nvlink-b": {
        "requests": [request("gpu.flexgpu.dev", 4)],
        "constraints": [{"requests": ["r"], "matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}],
    },
    "whole-gpu": {"requests": [request("gpu.flexgpu.dev")]},
    "mig-1g": {
        "requests": [
            request(
                "mig.flexgpu.dev",
                selectors=cel(f'device.attributes["{DRIVER_NAME}"].profile == "1g.10gb"'),
            )
        ]
    },
    "share-20gi": {
        "requests": [request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "20Gi"}})]
    },
}
EXPECTED_NODES = 2


def nodepool() -> dict[str, Any]:
    return {
        "apiVersion": f"{KARPENTER}/v1",
        "kind": "NodePool",
        "metadata": {"name": NODEPOOL},
        "spec": {
            "template": {
                "spec": {
                    "nodeClassRef": {"group": KWOK, "kind": "KWOKNodeClass", "name": "default"},
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": [INSTANCE_NAME],
                        },
                        {
                            "key": "karpenter.sh/capacity-type",
                            "operator": "In",
                            "values": ["on-demand"],
                        },
                    ],
                    "expireAfter": "Never",
                }
            },
            "disruption": {
                "consolidationPolicy": "WhenEmptyOrUnderutilized",
                "consolidateAfter": "0s",
                # The default budget (10% of nodes) would remove one node at a time.
                "budgets": [{"nodes": "100%"}],
            },
        },
    }


def pod(name: str, done: Path) -> dict[str, Any]:
    """Runs until ``done``/<name> exists, then exits 0; only Karpenter's nodes may take it.
    Karpenter must not move it while it runs: without ``do-not-disrupt``, consolidation
    (Underutilized) may delete a busy node whose pods' claims fit another node's idle GPUs,
    evicting them (seen in a run: the node of four running pods went instead of the idle one),
    as a GPU job's owner would not have it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {f"{KARPENTER}/do-not-disrupt": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {NODEPOOL_LABEL: NODEPOOL},
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": [
                        "/bin/sh",
                        "-c",
                        f"while [ ! -e {done / name} ]; do sleep 0.2; done",
                    ],
                    "resources": {"requests": {"cpu": "100m"}, "claims": [{"name": "gpus"}]},
                }
            ],
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": name}],
        },
    }


def custom(api: Any) -> Any:
    return client.CustomObjectsApi(api)


def nodeclaims(api: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = custom(api).list_cluster_custom_object(
        KARPENTER, "v1", "nodeclaims"
    )["items"]
    return [nc for nc in items if nc["metadata"].get("labels", {}).get(NODEPOOL_LABEL) == NODEPOOL]


def published(api: Any, node: str) -> list[dict[str, Any]]:
    response: Any = client.ResourceV1Api(api).list_resource_slice(
        field_selector=f"spec.nodeName={node},spec.driver={DRIVER_NAME}", _preload_content=False
    )
    return current_pool(json.loads(response.data)["items"])


@pytest.fixture
def karpenter_world(
    cluster: Any, api: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Karpenter, NodeAgent]]:
    ensure_device_classes(api)
    workdir = tmp_path_factory.mktemp("karpenter")
    instance = instance_type(api)
    karpenter = Karpenter(cluster.kubeconfig, workdir, [instance])
    agent = NodeAgent(cluster.kubeconfig, {instance.name: instance}, {NODEPOOL})
    karpenter.start(api)
    agent.start()
    objects = custom(api)
    objects.create_cluster_custom_object(
        KWOK,
        "v1alpha1",
        "kwoknodeclasses",
        {
            "apiVersion": f"{KWOK}/v1alpha1",
            "kind": "KWOKNodeClass",
            "metadata": {"name": "default"},
        },
    )
    objects.create_cluster_custom_object(KARPENTER, "v1", "nodepools", nodepool())
    try:
        yield karpenter, agent
    finally:
        # Deleting the NodePool makes Karpenter remove what is left of its nodes.
        for group, version, plural, name in (
            (KARPENTER, "v1", "nodepools", NODEPOOL),
            (KWOK, "v1alpha1", "kwoknodeclasses", "default"),
        ):
            try:
                objects.delete_cluster_custom_object(group, version, plural, name)
            except client.ApiException as err:
                if err.status != 404:
                    raise
        try:
            wait_for(
                lambda: not nodeclaims(api),
                timeout_s=120,
                interval_s=1,
                what="Karpenter to remove its NodeClaims after the NodePool was deleted",
            )
        finally:
            agent.stop()
            karpenter.stop()


def test_karpenter_launches_flex_gpu_nodes_for_pending_claims_and_removes_them_idle(
    api: Any, namespace: str, tmp_path: Path, karpenter_world: tuple[Karpenter, NodeAgent]
) -> None:
    karpenter, agent = karpenter_world
    core = client.CoreV1Api(api)
    resource = client.ResourceV1Api(api)
    done = tmp_path / "done"
    done.mkdir()
    for name, devices in WORKLOADS.items():
        resource.create_namespaced_resource_claim_template(
            namespace,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {"spec": {"devices": devices}},
            },
        )
    created = time.monotonic()
    for name in WORKLOADS:
        core.create_namespaced_pod(namespace, pod(name, done))

    def pods() -> dict[str, Any]:
        return {p.metadata.name: p for p in core.list_namespaced_pod(namespace).items}

    def more_nodes_than_decided() -> None:
        launched = nodeclaims(api)
        if len(launched) > EXPECTED_NODES:
            raise AssertionError(
                f"Karpenter launched {len(launched)} nodes, more than its decision of "
                f"{EXPECTED_NODES}: the nodes did not serve what their template promised; "
                f"pods {states()}\nkarpenter log:\n{karpenter.log_tail(40)}"
            )

    def states() -> dict[str, tuple[str, str]]:
        return {n: (p.status.phase, p.spec.node_name) for n, p in pods().items()}

    # Karpenter's decision: the nodes it launched, each playing its part once up.
    def nodes_up() -> bool:
        more_nodes_than_decided()
        ready = [r for r in agent.records.values() if r.ready_s is not None or r.error]
        return len(ready) == EXPECTED_NODES

    try:
        wait_for(nodes_up, timeout_s=300, interval_s=1, what=f"{EXPECTED_NODES} nodes launched")
    except pytest.fail.Exception:
        pytest.fail(
            f"nodes {agent.records}; pods {states()}\nkarpenter log:\n{karpenter.log_tail(60)}"
        )
    assert not agent.errors(), agent.errors()

    # What the plugin published on each node is the template Karpenter simulated.
    instance = instance_type(api)
    template = render_node_template(load_topology(instance.topology), instance.policy)
    for node in agent.records:
        differences = template_differences(template, published(api, node), node)
        assert not differences, f"{node}:\n" + "\n".join(differences[:40])

    running_at: dict[str, float] = {}

    def all_running() -> bool:
        more_nodes_than_decided()
        for name, p in pods().items():
            if p.status.phase == "Running":
                running_at.setdefault(name, time.monotonic() - created)
        return len(running_at) == len(WORKLOADS)

    try:
        wait_for(all_running, timeout_s=300, interval_s=1, what="every GPU pod Running")
    except pytest.fail.Exception:
        pytest.fail(
            f"pods {states()}; nodes played {agent.records}\n"
            f"karpenter log:\n{karpenter.log_tail(60)}"
        )

    # Each node was initialized once its DRA driver published a complete pool (the
    # requested-dra-drivers annotation names flexgpu: Karpenter's DRA simulation chose it).
    claims = nodeclaims(api)
    assert len(claims) == EXPECTED_NODES, [nc["metadata"]["name"] for nc in claims]
    for nc in claims:
        assert nc["metadata"]["annotations"].get(f"{KARPENTER}/requested-dra-drivers") == (
            DRIVER_NAME
        ), nc["metadata"]["annotations"]
        conditions = {c["type"]: c["status"] for c in nc["status"].get("conditions", [])}
        assert conditions.get("Initialized") == "True", conditions
    launched = {nc["status"]["nodeName"] for nc in claims}
    assert launched == set(agent.records), (launched, agent.records)

    # The pods run on those nodes, on devices of the node's own pool.
    for name, p in pods().items():
        assert p.spec.node_name in launched, (name, p.spec.node_name)
        (status,) = p.status.resource_claim_statuses
        claim = resource.read_namespaced_resource_claim(status.resource_claim_name, namespace)
        results = claim.status.allocation.devices.results
        assert {r.pool for r in results} == {p.spec.node_name}, (name, results)
    # Nothing more was launched once the pods ran.
    assert len(nodeclaims(api)) == EXPECTED_NODES

    def finish(names: set[str]) -> None:
        for name in names:
            (done / name).touch()
        wait_for(
            lambda: all(pods()[n].status.phase == "Succeeded" for n in names),
            timeout_s=120,
            interval_s=1,
            what=f"{sorted(names)} Succeeded",
        )

    def removed(nodes: set[str]) -> bool:
        left = {nc["status"].get("nodeName") for nc in nodeclaims(api)}
        return not nodes & left and all(agent.records[n].gone_s for n in nodes)

    def wait_removed(nodes: set[str], what: str) -> None:
        try:
            wait_for(lambda: removed(nodes), timeout_s=300, interval_s=1, what=what)
        except pytest.fail.Exception:
            pytest.fail(
                f"left: {[nc['metadata']['name'] for nc in nodeclaims(api)]}; "
                f"nodes {agent.records}\nkarpenter log:\n{karpenter.log_tail(60)}"
            )

    # The work on one node ends (nvlink-b's; nvlink-a runs on the other): its pods succeed,
    # their claims are released, its GPUs go idle and consolidation removes it, while the
    # busy node stays with its pods running.
    placed = {n: p.spec.node_name for n, p in pods().items()}
    idle = placed["nvlink-b"]
    (busy,) = launched - {idle}
    finished = time.monotonic()
    finish({n for n, node in placed.items() if node == idle})
    wait_removed({idle}, f"consolidation removed the idle node {idle}")
    one_removed_after = time.monotonic() - finished
    assert {nc["status"]["nodeName"] for nc in nodeclaims(api)} == {busy}
    still = {n: p.status.phase for n, p in pods().items() if placed[n] == busy}
    assert set(still.values()) == {"Running"}, still

    # Then the rest ends and the last node goes too.
    finished = time.monotonic()
    finish({n for n, node in placed.items() if node == busy})
    wait_removed(launched, "consolidation removed every idle GPU node")
    removed_after = time.monotonic() - finished
    for node in launched:
        assert not published(api, node), f"{node}: slices left after the node went away"
        with pytest.raises(client.ApiException) as gone:
            core.read_node(node)
        assert gone.value.status == 404
    ready = sorted(r.ready_s - r.seen_s for r in agent.records.values() if r.ready_s is not None)
    print(
        f"\nautoscale e2e: {len(launched)} nodes; pods on the first removed "
        f"{sorted(n for n, node in placed.items() if node == idle)}; pending to Running per pod "
        f"{ {n: round(s, 1) for n, s in sorted(running_at.items())} } s; node up to plugin "
        f"registered {[round(s, 1) for s in ready]} s; pods done to node removed "
        f"{one_removed_after:.1f} s (one node, the other busy), {removed_after:.1f} s (the last)"
    )
