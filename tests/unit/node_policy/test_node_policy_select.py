"""select_policy (priority, ties, label selectors) and gpu_modes (selectors, later entry wins)."""

from __future__ import annotations

from typing import Any

import pytest
from policy_builders import gpus_of, manifest, policy

from flexgpu.driver.node_policy import GpuMode, LabelSelector, parse_node_policy, select_policy

H100_NODE = {"kubernetes.io/hostname": "n1", "gpu": "h100", "flexgpu.dev/pool": "training"}


def test_highest_priority_wins() -> None:
    low = policy("low", priority=1)
    high = policy("high", priority=5, nodeSelector={"matchLabels": {"gpu": "h100"}})
    other = policy("other", priority=9, nodeSelector={"matchLabels": {"gpu": "a100"}})
    choice = select_policy([low, other, high], H100_NODE)
    assert choice.policy is high
    assert not choice.is_conflict
    assert [p.name for p in choice.matching] == ["high", "low"]
    assert choice.conflict_message("n1") == ""


def test_negative_priority_loses_to_default() -> None:
    fallback = policy("fallback", priority=-1)
    default = policy("default")
    assert select_policy([fallback, default], {}).policy is default


def test_tie_at_the_top_is_a_conflict_naming_the_tied_policies() -> None:
    b = policy("b", priority=3)
    a = policy("a", priority=3, nodeSelector={"matchLabels": {"gpu": "h100"}})
    low = policy("low", priority=1)
    choice = select_policy([b, low, a], H100_NODE)
    assert choice.policy is None
    assert choice.is_conflict
    assert [p.name for p in choice.conflict] == ["a", "b"]
    assert [p.name for p in choice.matching] == ["a", "b", "low"]
    assert choice.conflict_message("n1") == (
        "policies a, b all select node n1 with priority 3; none is applied and the node keeps "
        "its current GPU configuration until one has a higher priority or stops selecting the "
        "node"
    )


def test_tie_below_the_top_is_no_conflict() -> None:
    top = policy("top", priority=2)
    choice = select_policy([policy("x"), policy("y"), top], {})
    assert choice.policy is top and not choice.is_conflict


def test_no_matching_policy() -> None:
    only_a100 = policy("a100", nodeSelector={"matchLabels": {"gpu": "a100"}})
    choice = select_policy([only_a100], H100_NODE)
    assert choice.policy is None and not choice.is_conflict and choice.matching == ()
    assert select_policy([], H100_NODE).policy is None


def test_policies_being_deleted_do_not_count() -> None:
    body = manifest("going", priority=100)
    body["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    going = parse_node_policy(body)
    staying = policy("staying")
    assert select_policy([going, staying], {}).policy is staying


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchLabels": {"gpu": "h100"}}, {"gpu": "h100"}, True),
        ({"matchLabels": {"gpu": "h100"}}, {"gpu": "a100"}, False),
        ({"matchLabels": {"gpu": "h100"}}, {}, False),
        ({"matchLabels": {"gpu": ""}}, {"gpu": ""}, True),
        (
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a", "b"]}]},
            {"gpu": "b"},
            True,
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "gpu", "operator": "NotIn", "values": ["a"]}]},
            {"gpu": "a"},
            False,
        ),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists", "values": []}]}, {}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": "x"}, False),
        (
            {
                "matchLabels": {"flexgpu.dev/pool": "training"},
                "matchExpressions": [{"key": "gpu", "operator": "Exists"}],
            },
            {"flexgpu.dev/pool": "training"},
            False,
        ),
    ],
)
def test_label_selector(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is expected


# --------------------------------------------------------------------------- gpu_modes


def test_later_entry_wins_and_uncovered_gpus_are_left_out() -> None:
    gpus = gpus_of("hgx-h100-8")
    chosen = policy(
        gpus=[
            {"selector": {"all": True}, "mode": "Whole"},
            {"selector": {"indices": [0, 1, 2, 3]}, "mode": "MIG", "migLayout": {"1g.10gb": 7}},
            {"selector": {"indices": [3]}, "mode": "DynamicMIG"},
            {"selector": {"indices": [7]}, "mode": "Shared"},
        ],
        sharing={"strategy": "MPS"},
        health={"ignoredXids": [79, 13]},
    )
    modes = gpu_modes_of(chosen, gpus)
    assert modes == {
        0: ("MIG", {"1g.10gb": 7}, 1),
        1: ("MIG", {"1g.10gb": 7}, 1),
        2: ("MIG", {"1g.10gb": 7}, 1),
        3: ("DynamicMIG", None, 2),
        4: ("Whole", None, 0),
        5: ("Whole", None, 0),
        6: ("Whole", None, 0),
        7: ("Shared", None, 3),
    }
    from flexgpu.driver.node_policy import gpu_modes

    spec = gpu_modes(chosen, gpus)[7]
    assert spec.sharing is not None and spec.sharing.strategy == "MPS"
    assert spec.ignored_xids == (13, 79)
    assert list(gpu_modes(chosen, gpus)) == list(range(8))


def gpu_modes_of(chosen: Any, gpus: Any) -> dict[int, tuple[str, Any, int]]:
    from flexgpu.driver.node_policy import gpu_modes

    return {
        index: (spec.mode.value, spec.mig_layout, spec.entry)
        for index, spec in gpu_modes(chosen, gpus).items()
    }


def test_product_name_exact_and_glob() -> None:
    gpus = gpus_of("mixed")  # 0: Tesla T4, 1: NVIDIA A100-SXM4-80GB
    exact = policy(gpus=[{"selector": {"productName": "Tesla T4"}, "mode": "Shared"}])
    assert gpu_modes_of(exact, gpus) == {0: ("Shared", None, 0)}
    glob = policy(gpus=[{"selector": {"productName": "NVIDIA A100*"}, "mode": "DynamicMIG"}])
    assert gpu_modes_of(glob, gpus) == {1: ("DynamicMIG", None, 0)}
    case = policy(gpus=[{"selector": {"productName": "nvidia a100*"}, "mode": "DynamicMIG"}])
    assert gpu_modes_of(case, gpus) == {}
    prefix_only = policy(gpus=[{"selector": {"productName": "NVIDIA A100"}, "mode": "Whole"}])
    assert gpu_modes_of(prefix_only, gpus) == {}


def test_indices_not_on_the_node_select_nothing() -> None:
    chosen = policy(gpus=[{"selector": {"indices": [5, 9]}, "mode": "Whole"}])
    assert gpu_modes_of(chosen, gpus_of("mixed")) == {}


def test_no_entries_cover_nothing() -> None:
    assert gpu_modes_of(policy(), gpus_of("hgx-h100-8")) == {}


def test_mode_enum_values() -> None:
    assert [m.value for m in GpuMode] == ["Whole", "Shared", "MIG", "DynamicMIG"]
