"""The chart's node steering values: off by default; on, the controller gets its flags and
the right to write DeviceTaintRules even with GPU clearing off, and the admission policy
lets it taint only under the keys of the features turned on."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from flexgpu.controller.main import config_from_args, parse_args
from tests.unit.test_chart import CHART, find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py

POLICY = "own-device-taint-rules"


def _args(docs: list[dict[str, Any]]) -> list[str]:
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    return list(spec["containers"][0]["args"])


def _taint_rule_verbs(docs: list[dict[str, Any]]) -> set[str]:
    rules = find(docs, "ClusterRole", "controller")["rules"]
    return {
        verb
        for rule in rules
        if "resource.k8s.io" in rule["apiGroups"] and "devicetaintrules" in rule["resources"]
        for verb in rule["verbs"]
    }


def _policy_keys_check(docs: list[dict[str, Any]]) -> str | None:
    policies = [
        d
        for d in docs
        if d["kind"] == "ValidatingAdmissionPolicy" and POLICY in d["metadata"]["name"]
    ]
    if not policies:
        return None
    return str(policies[0]["spec"]["validations"][1]["expression"])


def test_off_by_default_no_flags_and_the_controller_config_says_off(helm: Path) -> None:
    docs = render(helm)
    assert not [a for a in _args(docs) if a.startswith("--node-steering")]
    assert config_from_args(parse_args(_args(docs))).node_steering_share == 0.0
    check = _policy_keys_check(docs)
    assert check is not None and "flexgpu.dev/node-steering" not in check


def test_on_alone_passes_its_values_and_grants_only_what_the_rules_need(helm: Path) -> None:
    docs = render(
        helm,
        "controller.clearing.enabled=false",
        "controller.nodeSteering.enabled=true",
        # helm's --set gives fractions as strings: the schema takes them as numbers.
        "controller.nodeSteering.share=0.25",
        "controller.nodeSteering.maxHeldShare=0.3",
        "controller.nodeSteering.maxDuration=2h",
    )
    config = config_from_args(parse_args(_args(docs)))
    assert (
        config.clearing_share,
        config.node_steering_share,
        config.node_steering_max_held_share,
        config.node_steering_max_s,
    ) == (0.0, 0.25, 0.3, 7200.0)
    assert _taint_rule_verbs(docs) == {"get", "list", "create", "delete"}
    check = _policy_keys_check(docs)
    assert check is not None
    assert 'object.spec.taint.key in ["flexgpu.dev/node-steering"]' in check


def test_both_on_allow_both_keys_and_both_off_only_delete_what_they_left(helm: Path) -> None:
    """Both off: no rule may be created, but the controller may still list and delete its
    own (the policy still binds), so rules left by a feature turned off go away."""
    both = _policy_keys_check(render(helm, "controller.nodeSteering.enabled=true"))
    assert both is not None
    assert '["flexgpu.dev/clearing", "flexgpu.dev/node-steering"]' in both
    off = render(helm, "controller.clearing.enabled=false")
    assert _taint_rule_verbs(off) == {"get", "list", "delete"}
    check = _policy_keys_check(off)
    assert check is not None and "object.spec.taint.key in []" in check


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller.nodeSteering.share=0", "/controller/nodeSteering/share"),
        ("controller.nodeSteering.share=2", "/controller/nodeSteering/share"),
        ("controller.nodeSteering.share=1.5", "/controller/nodeSteering/share"),
        ("controller.nodeSteering.share=0.0", "/controller/nodeSteering/share"),
        ("controller.clearing.maxShare=half", "/controller/clearing/maxShare"),
        ("controller.nodeSteering.maxHeldShare=2", "/controller/nodeSteering/maxHeldShare"),
        ("controller.nodeSteering.maxDuration=soon", "/controller/nodeSteering/maxDuration"),
        (
            "controller.nodeSteering.maxDuration=0s",
            "controller.nodeSteering.maxDuration 0s: must be more than 0, such as 1h",
        ),
        ("controller.nodeSteering.often=1", "additional properties 'often' not allowed"),
        # A comma would split the flag's list: refused as the label value it cannot be.
        (
            "controller.nodeSteering.nodeSelector.pool=a\\,b",
            "/controller/nodeSteering/nodeSelector/pool",
        ),
        (
            "controller.nodeSteering.eviction.enabled=true,controller.nodeSteering.eviction.maxInFlight=0",
            "/controller/nodeSteering/eviction/maxInFlight",
        ),
        (
            "controller.nodeSteering.eviction.enabled=true,controller.nodeSteering.eviction.after=soon",
            "/controller/nodeSteering/eviction/after",
        ),
        (
            "controller.nodeSteering.eviction.enabled=true,controller.nodeSteering.eviction.after=0m",
            "controller.nodeSteering.eviction.after 0m: must be more than 0, such as 10m",
        ),
        (
            "controller.nodeSteering.eviction.enabled=true,controller.nodeSteering.eviction.often=1",
            "additional properties 'often' not allowed",
        ),
    ],
)
def test_bad_values_fail_naming_the_field(helm: Path, value: str, message: str) -> None:
    result = subprocess.run(
        [
            str(helm),
            "template",
            "t",
            str(CHART),
            "--set",
            "controller.nodeSteering.enabled=true",
            "--set",
            value,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_the_node_selector_names_the_steered_group(helm: Path) -> None:
    docs = render(
        helm,
        "controller.nodeSteering.enabled=true",
        "controller.nodeSteering.nodeSelector.pool=gpu",
        "controller.nodeSteering.nodeSelector.karpenter\\.sh/nodepool=flex",
    )
    config = config_from_args(parse_args(_args(docs)))
    assert config.node_steering_nodes == {"karpenter.sh/nodepool": "flex", "pool": "gpu"}
    assert not [
        a for a in _args(render(helm, "controller.nodeSteering.enabled=true")) if "nodes=" in a
    ]


def _evict_rights(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    rules = find(docs, "ClusterRole", "controller")["rules"]
    return {
        (resource, verb)
        for rule in rules
        for resource in rule["resources"]
        if resource in ("pods/eviction", "poddisruptionbudgets")
        for verb in rule["verbs"]
    }


EVICT_RIGHTS = {
    ("pods/eviction", "create"),
    ("poddisruptionbudgets", "get"),
    ("poddisruptionbudgets", "list"),
    ("poddisruptionbudgets", "watch"),
}


def test_eviction_is_off_by_default_and_steering_alone_grants_no_right_to_evict(
    helm: Path,
) -> None:
    docs = render(helm, "controller.nodeSteering.enabled=true")
    assert not [a for a in _args(docs) if a.startswith("--node-steering-evict")]
    assert config_from_args(parse_args(_args(docs))).node_steering_evict_after_s is None
    assert _evict_rights(docs) == set()
    # Eviction asked for while steering is off: nothing to evict for, neither flags nor right.
    off = render(helm, "controller.nodeSteering.eviction.enabled=true")
    assert not [a for a in _args(off) if a.startswith("--node-steering")]
    assert _evict_rights(off) == set()


def test_eviction_on_passes_its_values_and_grants_evict_and_budget_reads(helm: Path) -> None:
    docs = render(
        helm,
        "controller.clearing.enabled=false",
        "controller.nodeSteering.enabled=true",
        "controller.nodeSteering.eviction.enabled=true",
        "controller.nodeSteering.eviction.after=20m",
        "controller.nodeSteering.eviction.maxInFlight=2",
    )
    config = config_from_args(parse_args(_args(docs)))
    assert (config.node_steering_evict_after_s, config.node_steering_evict_max_in_flight) == (
        1200.0,
        2,
    )
    assert config.clearing_evict_after_s is None
    assert _evict_rights(docs) == EVICT_RIGHTS
    # No delete on pods, whichever eviction is on.
    rules = find(docs, "ClusterRole", "controller")["rules"]
    assert not [r for r in rules if "pods" in r["resources"] and "delete" in r["verbs"]]
    # Both evictions on: the rights once, each with its own flags.
    both = render(
        helm,
        "controller.clearing.eviction.enabled=true",
        "controller.nodeSteering.enabled=true",
        "controller.nodeSteering.eviction.enabled=true",
    )
    config = config_from_args(parse_args(_args(both)))
    assert (config.clearing_evict_after_s, config.node_steering_evict_after_s) == (600.0, 600.0)
    assert _evict_rights(both) == EVICT_RIGHTS


def test_eviction_after_the_steering_bound_is_refused_by_the_controller(helm: Path) -> None:
    docs = render(
        helm,
        "controller.nodeSteering.enabled=true",
        "controller.nodeSteering.eviction.enabled=true",
        "controller.nodeSteering.eviction.after=2h",
    )
    with pytest.raises(SystemExit):
        parse_args(_args(docs))
