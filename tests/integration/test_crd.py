"""The generated GpuNodePolicy CRD (crds/) is accepted by a real kube-apiserver, and the
apiserver's schema enforces what the pydantic model enforces for the cases that matter most."""

from __future__ import annotations

import contextlib
import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver import node_policy
from flexgpu.driver.names import CRD_GROUP

pytestmark = pytest.mark.integration


def _policy(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": node_policy.API_VERSION,
        "kind": node_policy.KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


VALID_SPEC: dict[str, Any] = {
    "nodeSelector": {
        "matchLabels": {"flexgpu.dev/pool": "training"},
        "matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}],
    },
    "priority": 10,
    "gpus": [
        {"selector": {"all": True}, "mode": "Whole"},
        {"selector": {"productName": "NVIDIA H100*"}, "mode": "MIG", "migLayout": {"1g.10gb": 7}},
        {"selector": {"indices": [6, 7]}, "mode": "DynamicMIG"},
    ],
    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10Gi"}},
    "health": {"ignoredXids": [13, 31]},
}


class Policies:
    """GpuNodePolicy calls of CustomObjectsApi; deletes what it created."""

    def __init__(self, api: Any) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.created: list[str] = []
        self.where = (CRD_GROUP, node_policy.VERSION, node_policy.PLURAL)

    def create(self, body: dict[str, Any]) -> Any:
        result = self.custom.create_cluster_custom_object(*self.where, body)
        self.created.append(body["metadata"]["name"])
        return result

    def get(self, name: str) -> Any:
        return self.custom.get_cluster_custom_object(*self.where, name)

    def patch_status(self, name: str, patch: dict[str, Any]) -> Any:
        # CustomObjectsApi sends a dict body as application/merge-patch+json.
        return self.custom.patch_cluster_custom_object_status(*self.where, name, patch)

    def cleanup(self) -> None:
        for name in self.created:
            with contextlib.suppress(client.ApiException):
                self.custom.delete_cluster_custom_object(*self.where, name)


@pytest.fixture
def objects(api: Any, crd_installed: None) -> Iterator[Policies]:
    policies = Policies(api)
    yield policies
    policies.cleanup()


def _name() -> str:
    return f"gnp-{uuid.uuid4().hex[:8]}"


def test_valid_policy_is_stored_and_parses_back(objects: Policies) -> None:
    name = _name()
    stored = objects.create(_policy(name, **VALID_SPEC))
    assert stored["spec"]["priority"] == 10
    assert stored["spec"]["gpus"][1]["migLayout"] == {"1g.10gb": 7}
    policy = node_policy.parse_node_policy(stored)
    assert policy.name == name
    assert [g.mode for g in policy.spec.gpus] == ["Whole", "MIG", "DynamicMIG"]


def test_priority_defaults_to_zero(objects: Policies) -> None:
    stored = objects.create(_policy(_name(), gpus=[{"selector": {"all": True}, "mode": "Shared"}]))
    assert stored["spec"]["priority"] == 0
    assert node_policy.parse_node_policy(stored).spec.priority == 0


def _rejected(objects: Policies, body: dict[str, Any]) -> str:
    with pytest.raises(client.ApiException) as caught:
        objects.create(body)
    assert caught.value.status == 422, caught.value.body
    return str(caught.value.body)


def test_bad_mode_is_rejected_by_the_apiserver(objects: Policies) -> None:
    spec = copy.deepcopy(VALID_SPEC)
    spec["gpus"][0]["mode"] = "Mig"
    body = _rejected(objects, _policy(_name(), **spec))
    assert "spec.gpus[0].mode" in body
    assert 'Unsupported value: \\"Mig\\"' in body or 'Unsupported value: "Mig"' in body


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"selector": {"all": True}, "mode": "MIG"}, "migLayout is required with mode MIG"),
        (
            {"selector": {"all": True}, "mode": "Whole", "migLayout": {"1g.10gb": 1}},
            "migLayout is required with mode MIG",
        ),
        (
            {"selector": {"all": True, "indices": [0]}, "mode": "Whole"},
            "set exactly one of productName, indices, all",
        ),
        ({"selector": {}, "mode": "Whole"}, "set exactly one of productName, indices, all"),
        (
            {"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g.10gb": 0}},
            "spec.gpus[0].migLayout.1g.10gb",
        ),
    ],
)
def test_cross_field_rules_are_enforced_by_the_apiserver(
    objects: Policies, entry: dict[str, Any], expected: str
) -> None:
    body = _rejected(objects, _policy(_name(), gpus=[entry]))
    assert expected in body
    # The model rejects the same objects.
    with pytest.raises(node_policy.NodePolicyError):
        node_policy.parse_node_policy(_policy("x", gpus=[entry]))


def test_label_selector_rules_are_enforced_by_the_apiserver(objects: Policies) -> None:
    selector = {"matchExpressions": [{"key": "gpu", "operator": "In"}]}
    body = _rejected(objects, _policy(_name(), nodeSelector=selector))
    assert "values must be non-empty with operators In and NotIn" in body


def test_status_subresource_takes_a_node_entry_by_merge_patch(objects: Policies) -> None:
    from datetime import UTC, datetime

    name = _name()
    objects.create(_policy(name, **VALID_SPEC))
    now = datetime(2025, 1, 1, tzinfo=UTC)
    gpus = {
        "0": node_policy.GpuStatus(
            mode=node_policy.GpuMode.MIG,
            migLayout={"1g.10gb": 7},
            productName="NVIDIA H100 80GB HBM3",
            reason=node_policy.PolicyReason.APPLIED,
        )
    }
    status, reason, message = node_policy.node_condition(gpus)
    entry = node_policy.NodeStatus(
        observedGeneration=1,
        gpus=gpus,
        conditions=node_policy.set_condition(
            [], "Applied", status=status, reason=reason, message=message, now=now
        ),
    )
    for node in ("node-a", "node-b"):
        objects.patch_status(name, node_policy.node_status_patch(node, entry))
    # node-a changes layout: the stale profile key must go, node-b must stay.
    changed = entry.model_copy(
        update={"gpus": {"0": gpus["0"].model_copy(update={"migLayout": {"3g.40gb": 2}})}}
    )
    objects.patch_status(name, node_policy.node_status_patch("node-a", changed, entry))
    stored = objects.get(name)
    policy = node_policy.parse_node_policy(stored)
    assert policy.status is not None
    assert policy.status.nodes["node-a"].gpus["0"].migLayout == {"3g.40gb": 2}
    assert policy.status.nodes["node-b"].gpus["0"].migLayout == {"1g.10gb": 7}
    assert policy.status.nodes["node-a"].conditions[0].lastTransitionTime == "2025-01-01T00:00:00Z"
    objects.patch_status(name, node_policy.node_status_removal("node-b"))
    stored = objects.get(name)
    assert sorted(stored["status"]["nodes"]) == ["node-a"]


def test_printer_columns_and_short_name(api: Any, crd_installed: None) -> None:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(node_policy.CRD_NAME)
    version = crd.spec.versions[0]
    assert [c.name for c in version.additional_printer_columns] == ["Priority", "Age"]
    assert crd.spec.names.short_names == ["gnp"]
    assert crd.spec.scope == "Cluster"
