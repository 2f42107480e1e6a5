"""The rights behind claim node labels, tried with the chart's own ServiceAccount tokens
against the real control plane (the chart installed with helm at its defaults): the
controller may set, change or remove the label gpu.flexgpu.dev/node of a claim (by a patch, or
a replace of the claim as read), to the node of its flexgpu devices only, and write nothing
else of any claim; the plugin reads the
controller's Lease by name and no other Lease, and labels no claim. docs/security.md names
each row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.claim_node_label import CLAIM_NODE_LABEL
from tests.conftest import target_minor
from tests.integration.test_chart_attacks import (
    DRIVER,
    GRANULAR,
    _allocated_claim,
    _controller,
    _plugin_of,
)
from tests.integration.test_chart_install import (
    NODE_A,
    NODE_B,
    NS,
    RELEASE,
    _denial,
    _policies_loaded,
    installed,
)
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

__all__ = ["installed"]

LABEL_POLICY_MESSAGE = "may only change the label gpu.flexgpu.dev/node"


def _label(value: str | None) -> dict[str, Any]:
    return {"metadata": {"labels": {CLAIM_NODE_LABEL: value}}}


def _relabelled(claims: Any, namespace: str, labels: dict[str, str]) -> Any:
    read = claims.read_namespaced_resource_claim("on-b", namespace)
    read.metadata.labels = {**(read.metadata.labels or {}), **labels}
    return read


def test_controller_labels_claims_with_their_node_and_writes_nothing_else(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    _allocated_claim(api, namespace, "on-b", NODE_B, [(DRIVER, NODE_B, "gpu-0")])
    client.ResourceV1Api(api).create_namespaced_resource_claim(
        namespace,
        {"metadata": {"name": "unallocated"}, "spec": {"devices": {"requests": []}}},
    )
    claims: Any = client.ResourceV1Api(_controller(cluster, api))
    _policies_loaded(
        lambda **kw: claims.patch_namespaced_resource_claim(
            "on-b", namespace, {"metadata": {"labels": {"x": "y"}}}, **kw
        )
    )
    # Allowed: the label naming the claim's node, then off again.
    claims.patch_namespaced_resource_claim("on-b", namespace, _label(NODE_B))
    read = claims.read_namespaced_resource_claim("on-b", namespace)
    assert read.metadata.labels[CLAIM_NODE_LABEL] == NODE_B
    claims.patch_namespaced_resource_claim("on-b", namespace, _label(None))
    # The replace it falls back to where the server takes a patch for a spec change.
    claims.replace_namespaced_resource_claim(
        "on-b", namespace, _relabelled(claims, namespace, {CLAIM_NODE_LABEL: NODE_B})
    )
    rows = {
        "label with another node": lambda: claims.patch_namespaced_resource_claim(
            "on-b", namespace, _label(NODE_A)
        ),
        "label an unallocated claim": lambda: claims.patch_namespaced_resource_claim(
            "unallocated", namespace, _label(NODE_A)
        ),
        "another label": lambda: claims.patch_namespaced_resource_claim(
            "on-b", namespace, {"metadata": {"labels": {"team": "mine"}}}
        ),
        "an annotation": lambda: claims.patch_namespaced_resource_claim(
            "on-b", namespace, {"metadata": {"annotations": {"x": "y"}}}
        ),
        "a finalizer": lambda: claims.patch_namespaced_resource_claim(
            "on-b", namespace, {"metadata": {"finalizers": ["example.com/keep"]}}
        ),
        "replace a claim with another label": lambda: claims.replace_namespaced_resource_claim(
            "on-b", namespace, _relabelled(claims, namespace, {"team": "mine"})
        ),
        "delete a claim": lambda: claims.delete_namespaced_resource_claim("on-b", namespace),
        "create a claim": lambda: claims.create_namespaced_resource_claim(
            namespace, {"metadata": {"name": "planted"}, "spec": {"devices": {"requests": []}}}
        ),
        "write a claim's status": lambda: claims.patch_namespaced_resource_claim_status(
            "on-b", namespace, {"status": {"devices": []}}
        ),
    }
    refused = {what: _denial(call) for what, call in rows.items()}
    assert "must name the node of the claim's gpu.flexgpu.dev" in refused["label with another node"]
    assert "must name the node" in refused["label an unallocated claim"]
    for what in (
        "another label",
        "an annotation",
        "a finalizer",
        "replace a claim with another label",
    ):
        assert LABEL_POLICY_MESSAGE in refused[what], what
    for what in ("delete a claim", "create a claim", "write a claim's status"):
        assert "forbidden" in refused[what].lower(), what


def test_plugin_reads_only_the_controllers_lease_and_labels_no_claim(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    """Granted with binding conditions (1.36+): the Lease that says whether claims are
    labelled, by name; before 1.36 the chart grants no Lease at all."""
    create_simulated_node(api, NODE_A)
    token = _plugin_of(cluster, api, NODE_A)
    leases: Any = client.CoordinationV1Api(token)
    own = f"{RELEASE}-controller"
    if target_minor() >= GRANULAR:
        try:
            leases.read_namespaced_lease(own, NS)
        except client.ApiException as error:
            assert error.status == 404, error  # allowed; absent until a controller runs
        leases.list_namespaced_lease(NS, field_selector=f"metadata.name={own}")
    else:
        assert "forbidden" in _denial(leases.read_namespaced_lease, own, NS).lower()
    _allocated_claim(api, namespace, "on-a", NODE_A, [(DRIVER, NODE_A, "gpu-0")])
    claims: Any = client.ResourceV1Api(token)
    rows = {
        "list every Lease of the namespace": lambda: leases.list_namespaced_lease(NS),
        "read another Lease": lambda: leases.read_namespaced_lease("another-leader", NS),
        "read a node's Lease": lambda: leases.read_namespaced_lease(NODE_A, "kube-node-lease"),
        "renew the controller's Lease": lambda: leases.patch_namespaced_lease(
            own, NS, {"spec": {"holderIdentity": "plugin"}}
        ),
        "label its own claim": lambda: claims.patch_namespaced_resource_claim(
            "on-a", namespace, _label(NODE_A)
        ),
    }
    for what, call in rows.items():
        assert "forbidden" in _denial(call).lower(), what
