"""Claims labelled with their node, on a real control plane: the controller's labelling
(claim reflector, elector, labeller as controller/app.py wires them) and two hollow nodes
running the plugin's own claim watch code (bench/node_watchers.py). A node's watch receives
none of another node's claim changes once labels are live, still receives its own (claims
allocated before the controller ran included), and falls back to every claim when the
controller stops; the chart's rights for this are tried from the denied side in
test_chart_attacks.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client

from bench.node_watchers import HollowNode, LabellingController, allocated_claim, lease_marked
from flexgpu.driver.claim_node_label import CLAIM_NODE_LABEL
from tests.conftest import wait_for
from tools.cluster import ControlPlane

pytestmark = pytest.mark.integration


def _labels(api: Any, namespace: str, name: str) -> dict[str, str]:
    read = client.ResourceV1Api(api).read_namespaced_resource_claim(name, namespace)
    return dict(read.metadata.labels or {})


def test_a_nodes_watch_receives_only_its_own_claims_changes(
    cluster: ControlPlane, api: Any, namespace: str
) -> None:
    run = uuid.uuid4().hex[:6]
    node_a, node_b = f"label-a-{run}", f"label-b-{run}"
    # Allocated before any controller labelled claims (an upgrade): labelled by its first pass.
    allocated_claim(api, namespace, "before-upgrade", node_a)
    controller = LabellingController(cluster.api_client(), identity=f"ctl-{run}")
    controller.start()
    # Widening after 5 s rather than 2 minutes: the test waits for it.
    nodes = [HollowNode(cluster.kubeconfig, n, controller.lease, 5.0) for n in (node_a, node_b)]
    try:
        wait_for(lambda: lease_marked(api), what="lease marked live")
        assert _labels(api, namespace, "before-upgrade")[CLAIM_NODE_LABEL] == node_a
        for node in nodes:
            node.start()
        a, b = nodes
        wait_for(lambda: a.claims and a.claims.synced and b.claims and b.claims.synced)
        assert a.query() == {"labelSelector": f"{CLAIM_NODE_LABEL}={node_a}"}
        assert a.claims is not None and b.claims is not None
        assert [c["metadata"]["name"] for c in a.claims.items()] == ["before-upgrade"]
        b.api.reset()
        # Changes of node A's claims: created, allocated, labelled, changed, deleted.
        resource: Any = client.ResourceV1Api(api)
        for i in range(5):
            allocated_claim(api, namespace, f"on-a-{i}", node_a)
        wait_for(lambda: len(a.claims.items()) == 6, what="node A sees its 6 claims")
        resource.patch_namespaced_resource_claim(
            "on-a-0", namespace, {"metadata": {"annotations": {"touched": "yes"}}}
        )
        for i in range(5):
            resource.delete_namespaced_resource_claim(f"on-a-{i}", namespace)
        wait_for(lambda: len(a.claims.items()) == 1, what="node A sees the deletions")
        # Node B's own claim reaches it, and only then anything reaches it at all.
        assert b.api.claim_events.events == 0, "node B received node A's claim changes"
        allocated_claim(api, namespace, "on-b", node_b)
        wait_for(lambda: b.claims and [c["metadata"]["name"] for c in b.claims.items()] == ["on-b"])
        assert b.api.claim_events.events >= 1
        # The controller stops: its lease runs out and the nodes widen to every claim.
        controller.stop()
        wait_for(lambda: a.query() == {}, timeout_s=30, what="node A's scope widened")
    finally:
        for node in nodes:
            node.stop()
        controller.stop()
