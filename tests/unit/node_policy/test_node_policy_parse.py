"""parse_node_policy: what a valid policy looks like, and the exact texts of rejections."""

from __future__ import annotations

from typing import Any

import pytest
from policy_builders import manifest

from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import (
    API_VERSION,
    KIND,
    MAX_PROBLEMS,
    VERSION,
    GpuMode,
    NodePolicyError,
    SelectorOperator,
    parse_node_policy,
)
from flexgpu.driver.opaque_config import SharingStrategy

FULL: dict[str, Any] = manifest(
    "training",
    nodeSelector={
        "matchLabels": {"flexgpu.dev/pool": "training"},
        "matchExpressions": [
            {"key": "gpu", "operator": "In", "values": ["h100", "h200"]},
            {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"},
        ],
    },
    priority=10,
    gpus=[
        {"selector": {"all": True}, "mode": "Whole"},
        {
            "selector": {"productName": "NVIDIA H100*"},
            "mode": "MIG",
            "migLayout": {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2},
        },
        {"selector": {"indices": [6, 7]}, "mode": "DynamicMIG"},
        {"selector": {"indices": [5]}, "mode": "Shared"},
    ],
    sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}},
    health={"ignoredXids": [13, 31]},
)


def test_full_policy_parses() -> None:
    policy = parse_node_policy(FULL)
    assert policy.name == "training"
    spec = policy.spec
    assert spec.priority == 10
    assert spec.nodeSelector.matchExpressions is not None
    assert spec.nodeSelector.matchExpressions[1].operator is SelectorOperator.DOES_NOT_EXIST
    assert [entry.mode for entry in spec.gpus] == [
        GpuMode.WHOLE,
        GpuMode.MIG,
        GpuMode.DYNAMIC_MIG,
        GpuMode.SHARED,
    ]
    assert spec.gpus[1].migLayout == {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
    assert spec.sharing is not None and spec.sharing.strategy is SharingStrategy.TIME_SLICING
    assert spec.health is not None and spec.health.ignoredXids == [13, 31]
    assert policy.status is None


def test_type_meta_of_the_model_is_the_one_served_version() -> None:
    # The model's Literal types cannot name the constants; they must still agree.
    policy = parse_node_policy(manifest("a"))
    assert (policy.apiVersion, policy.kind) == (API_VERSION, KIND)
    assert f"{CRD_GROUP}/{VERSION}" == API_VERSION


def test_defaults() -> None:
    policy = parse_node_policy(manifest("empty"))
    assert policy.spec.priority == 0
    assert policy.spec.gpus == []
    assert policy.spec.nodeSelector.matches({})
    assert policy.spec.sharing is None and policy.spec.health is None


def test_object_from_the_api_with_metadata_and_status_parses() -> None:
    obj = dict(FULL)
    obj["metadata"] = {
        "name": "training",
        "uid": "0d6f",
        "generation": 3,
        "resourceVersion": "42",
        "creationTimestamp": "2025-01-01T00:00:00Z",
        "managedFields": [{"manager": "kubectl"}],
    }
    obj["status"] = {
        "matchedNodes": ["a"],
        "nodes": {
            "a": {
                "observedGeneration": 3,
                "gpus": {
                    "0": {
                        "mode": "MIG",
                        "migLayout": {"1g.10gb": 7},
                        "productName": "NVIDIA H100 80GB HBM3",
                        "reason": "Applied",
                        "message": "",
                    }
                },
                "conditions": [
                    {
                        "type": "Applied",
                        "status": "True",
                        "reason": "Applied",
                        "message": "1 GPU is as the policy asks",
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }
                ],
            }
        },
    }
    policy = parse_node_policy(obj)
    assert policy.metadata.generation == 3
    assert policy.status is not None
    assert policy.status.nodes["a"].gpus["0"].migLayout == {"1g.10gb": 7}


def _problems(**spec: Any) -> list[str]:
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy(manifest(**spec))
    return caught.value.problems


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"gpus": [{"selector": {"all": True}, "mode": "Mig"}]},
            'spec.gpus[0].mode: "Mig" is not allowed; allowed: Whole, Shared, MIG, DynamicMIG',
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": 1}]},
            "spec.gpus[0].mode: 1 is not allowed; allowed: Whole, Shared, MIG, DynamicMIG",
        ),
        (
            {"gpus": [{"selector": {"all": True}}]},
            "spec.gpus[0].mode: missing; allowed: Whole, Shared, MIG, DynamicMIG",
        ),
        (
            {"gpus": [{"mode": "Whole"}]},
            "spec.gpus[0].selector: missing; allowed: an object with fields productName, "
            "indices, all",
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "MIG"}]},
            "spec.gpus[0].migLayout: missing; allowed: required with mode MIG, a map of MIG "
            'profile name to count, e.g. {"1g.10gb": 7}',
        ),
        (
            {
                "gpus": [
                    {"selector": {"all": True}, "mode": "Whole"},
                    {"selector": {"all": True}, "mode": "Whole", "migLayout": {"1g.10gb": 7}},
                ]
            },
            "spec.gpus[1].migLayout: not allowed with mode Whole; allowed: only with mode MIG",
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g.10gb": 0}}]},
            'spec.gpus[0].migLayout["1g.10gb"]: 0 is not allowed; allowed: an integer from 1 to 64',
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g.10gb": "7"}}]},
            'spec.gpus[0].migLayout["1g.10gb"]: "7" is not allowed; allowed: an integer from 1 '
            "to 64",
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g10gb": 7}}]},
            'spec.gpus[0].migLayout: key "1g10gb" is not allowed; allowed: a MIG profile name '
            'such as "1g.10gb", "1g.10gb+me" or "3g.40gb"',
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "MIG", "migLayout": [["1g.10gb", 7]]}]},
            'spec.gpus[0].migLayout: [["1g.10gb", 7]] is not allowed; allowed: a map of MIG '
            'profile name to count, e.g. {"1g.10gb": 7}',
        ),
        (
            {"gpus": [{"selector": {}, "mode": "Whole"}]},
            "spec.gpus[0].selector: empty is not allowed; allowed: exactly one of productName, "
            "indices, all: true",
        ),
        (
            {"gpus": [{"selector": {"productName": "NVIDIA L4", "indices": [0]}, "mode": "Whole"}]},
            "spec.gpus[0].selector: productName and indices together are not allowed; allowed: "
            "exactly one of productName, indices, all: true",
        ),
        (
            {
                "gpus": [
                    {
                        "selector": {"productName": "NVIDIA L4", "indices": [0], "all": True},
                        "mode": "Whole",
                    }
                ]
            },
            "spec.gpus[0].selector: productName, indices and all together are not allowed; "
            "allowed: exactly one of productName, indices, all: true",
        ),
        (
            {"gpus": [{"selector": {"all": False}, "mode": "Whole"}]},
            "spec.gpus[0].selector.all: false is not allowed; allowed: true",
        ),
        (
            {"gpus": [{"selector": {"indices": []}, "mode": "Whole"}]},
            "spec.gpus[0].selector.indices: [] is not allowed; allowed: a non-empty list of at "
            "most 64 distinct GPU indices",
        ),
        (
            {"gpus": [{"selector": {"indices": [1, 1]}, "mode": "Whole"}]},
            "spec.gpus[0].selector.indices: [1, 1] is not allowed (1 twice); allowed: a "
            "non-empty list of at most 64 distinct GPU indices",
        ),
        (
            {"gpus": [{"selector": {"indices": [-1]}, "mode": "Whole"}]},
            "spec.gpus[0].selector.indices[0]: -1 is not allowed; allowed: a GPU index, an "
            "integer from 0 to 1023",
        ),
        (
            {"gpus": [{"selector": {"productName": ""}, "mode": "Whole"}]},
            'spec.gpus[0].selector.productName: "" is not allowed; allowed: a GPU product name, '
            'exact or a glob, e.g. "NVIDIA H100*"',
        ),
        (
            {"gpus": [{"selector": {"all": True}, "mode": "Whole", "layout": {}}]},
            "spec.gpus[0].layout: unknown field; allowed: selector, mode, migLayout, "
            "existingMigDevices",
        ),
        (
            {"gpus": {"selector": {"all": True}, "mode": "Whole"}},
            'spec.gpus: {"selector": {"all": true}, "mode": "Whole"} is not allowed; allowed: '
            "a list of at most 64 entries with selector and mode",
        ),
        (
            {"priority": "high"},
            'spec.priority: "high" is not allowed; allowed: an integer from -2147483648 to '
            "2147483647",
        ),
        (
            {"priority": 2**31},
            "spec.priority: 2147483648 is not allowed; allowed: an integer from -2147483648 to "
            "2147483647",
        ),
        (
            {"priority": 1.0},
            "spec.priority: 1.0 is not allowed; allowed: an integer from -2147483648 to 2147483647",
        ),
        (
            {"priority": True},
            "spec.priority: true is not allowed; allowed: an integer from -2147483648 to "
            "2147483647",
        ),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "gpu", "operator": "Equals"}]}},
            'spec.nodeSelector.matchExpressions[0].operator: "Equals" is not allowed; allowed: '
            "In, NotIn, Exists, DoesNotExist",
        ),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "gpu", "operator": "NotIn"}]}},
            "spec.nodeSelector.matchExpressions[0].values: missing with operator NotIn; "
            "allowed: a non-empty list with operators In and NotIn, none with Exists and "
            "DoesNotExist",
        ),
        (
            {
                "nodeSelector": {
                    "matchExpressions": [{"key": "gpu", "operator": "Exists", "values": ["a"]}]
                }
            },
            "spec.nodeSelector.matchExpressions[0].values: not allowed with operator Exists; "
            "allowed: a non-empty list with operators In and NotIn, none with Exists and "
            "DoesNotExist",
        ),
        (
            {"nodeSelector": {"matchLabels": {"a/b/c": "x"}}},
            'spec.nodeSelector.matchLabels: key "a/b/c" is not allowed; allowed: a label key: '
            'an optional DNS subdomain prefix and "/", then up to 63 letters, digits, "-", "_" '
            'or "." starting and ending with a letter or digit',
        ),
        (
            {"nodeSelector": {"matchLabels": {"gpu": "h100!"}}},
            'spec.nodeSelector.matchLabels["gpu"]: "h100!" is not allowed (not a label value); '
            'allowed: a label value: empty, or up to 63 letters, digits, "-", "_" or "." '
            "starting and ending with a letter or digit",
        ),
        (
            {"nodeSelector": {"matchExpressions": [{"key": "-gpu", "operator": "Exists"}]}},
            'spec.nodeSelector.matchExpressions[0].key: "-gpu" is not allowed (not a label '
            'name); allowed: a label key: an optional DNS subdomain prefix and "/", then up to '
            '63 letters, digits, "-", "_" or "." starting and ending with a letter or digit',
        ),
        (
            {"nodeSelector": {"matchLabel": {}}},
            "spec.nodeSelector.matchLabel: unknown field; allowed: matchLabels, matchExpressions",
        ),
        (
            {"sharing": {"strategy": "Shared"}},
            'spec.sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS',
        ),
        (
            {"sharing": {"strategy": "MPS", "timeSlicingConfig": {}}},
            "spec.sharing.timeSlicingConfig: not allowed with strategy MPS; allowed: only with "
            "strategy TimeSlicing",
        ),
        (
            {
                "sharing": {
                    "strategy": "MPS",
                    "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10GB"},
                }
            },
            'spec.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10GB" is not allowed '
            '(unknown suffix "GB"); allowed: a Kubernetes quantity of whole bytes greater than '
            '0, e.g. "10Gi"',
        ),
        (
            {"health": {"ignoredXids": [0]}},
            "spec.health.ignoredXids[0]: 0 is not allowed; allowed: an Xid, an integer from 1 "
            "to 2147483647",
        ),
        (
            {"health": {"ignoredXids": [13, 13]}},
            "spec.health.ignoredXids: [13, 13] is not allowed (13 twice); allowed: a list of at "
            "most 256 distinct Xids",
        ),
        (
            {"health": {"ignoreXids": [13]}},
            "spec.health.ignoreXids: unknown field; allowed: ignoredXids",
        ),
        (
            {"gpu": []},
            "spec.gpu: unknown field; allowed: nodeSelector, priority, gpus, sharing, health",
        ),
    ],
)
def test_rejection_texts(spec: dict[str, Any], expected: str) -> None:
    assert _problems(**spec) == [expected]


def test_top_level_rejections() -> None:
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy({})
    assert caught.value.problems == [
        "apiVersion: missing; allowed: flexgpu.dev/v1alpha1",
        "kind: missing; allowed: GpuNodePolicy",
        "metadata: missing; allowed: an object with the policy's name",
        "spec: missing; allowed: an object with fields nodeSelector, priority, gpus, sharing, "
        "health",
    ]
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy(
            {"apiVersion": "flexgpu.dev/v1", "kind": "NodePolicy", "metadata": {}, "spec": []}
        )
    assert caught.value.problems == [
        'apiVersion: "flexgpu.dev/v1" is not allowed; allowed: flexgpu.dev/v1alpha1',
        'kind: "NodePolicy" is not allowed; allowed: GpuNodePolicy',
        "metadata.name: missing; allowed: the policy's name, a non-empty string",
        "spec: [] is not allowed; allowed: an object with fields nodeSelector, priority, gpus, "
        "sharing, health",
    ]


def test_a_key_that_is_not_a_string_is_an_unknown_field() -> None:
    # Python callers can pass such a dict; it gets the same text as in opaque config.
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy({**manifest("a"), 1: 2})
    assert caught.value.problems == [
        "[1]: unknown field; allowed: apiVersion, kind, metadata, spec, status"
    ]


def test_sharing_block_problems_read_as_in_opaque_config() -> None:
    # spec.sharing is a GpuSharing: same paths and texts as in a claim's GpuConfig, with map
    # keys in brackets even when they look like field names.
    per_device = {"gpu0": "-1"}
    sharing = {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": per_device}}
    assert _problems(sharing=sharing) == [
        'spec.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["gpu0"]: "-1" is not allowed; '
        'allowed: a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"'
    ]


@pytest.mark.parametrize("obj", [[1], "x", None, 3])
def test_not_an_object(obj: Any) -> None:
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy(obj)
    (problem,) = caught.value.problems
    assert problem.startswith("object: ")
    assert problem.endswith(
        "is not allowed; allowed: a GpuNodePolicy object with apiVersion flexgpu.dev/v1alpha1"
    )


def test_every_problem_is_reported_and_the_list_is_capped() -> None:
    gpus = [{"selector": {"all": True}, "mode": f"M{i}"} for i in range(30)]
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy(manifest(gpus=gpus))
    problems = caught.value.problems
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[-1] == f"... and {30 - MAX_PROBLEMS} more problems"
    assert problems[0].startswith('spec.gpus[0].mode: "M0" is not allowed')
    assert isinstance(caught.value, ValueError)
    assert str(caught.value).startswith('spec.gpus[0].mode: "M0"')


def test_hostile_values_never_escape_as_other_errors() -> None:
    deep: Any = {}
    for _ in range(100):
        deep = {"x": deep}
    for spec in (
        {"priority": 10**5000},
        {"gpus": [deep]},
        {"nodeSelector": {"matchLabels": {"\ud800": "x"}}},
        {"gpus": [{"selector": {"productName": "\ud800"}, "mode": "\ud800"}]},
    ):
        with pytest.raises(NodePolicyError) as caught:
            parse_node_policy(manifest(**spec))
        for problem in caught.value.problems:
            problem.encode("utf-8")  # printable: no lone surrogates
    with pytest.raises(NodePolicyError) as caught:
        parse_node_policy(manifest(priority=10**5000))
    assert caught.value.problems == [
        "spec.priority: a 5001-digit integer is not allowed; allowed: an integer from "
        "-2147483648 to 2147483647"
    ]


def test_models_are_frozen_and_dump_back_to_the_manifest() -> None:
    policy = parse_node_policy(FULL)
    dumped = policy.model_dump(mode="json", exclude_none=True, exclude_defaults=False)
    assert dumped["spec"]["gpus"][1]["migLayout"] == {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
    again = parse_node_policy(dumped)
    assert again == policy
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error
        policy.spec.priority = 3  # type: ignore[misc]
