"""matchedNodes and the Conflict condition of GpuNodePolicies, written only when they change."""

from __future__ import annotations

from typing import Any

from controller_builders import NOW, node

from flexgpu.controller.policy_status import CONFLICT_CONDITION, desired_patches
from flexgpu.controller.records import node_record


def _policy(name: str, priority: int = 0, **labels: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"priority": priority}
    if labels:
        spec["nodeSelector"] = {"matchLabels": labels}
    return {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": name, "generation": 2},
        "spec": spec,
    }


NODES = {
    n["metadata"]["name"]: node_record(n)
    for n in (node("h1", {"gpu": "h100"}), node("h2", {"gpu": "h100"}), node("a1", {"gpu": "a100"}))
}


def _patches(*policies: dict[str, Any]) -> dict[str, Any]:
    raw = {p["metadata"]["name"]: p for p in policies}
    return {p.name: p.body["status"] for p in desired_patches(raw, NODES, NOW)}


def _condition(status: dict[str, Any]) -> dict[str, Any]:
    (condition,) = [c for c in status["conditions"] if c["type"] == CONFLICT_CONDITION]
    return condition


def test_matched_nodes_and_no_conflict() -> None:
    out = _patches(_policy("h100s", gpu="h100"), _policy("a100s", gpu="a100"))
    assert out["h100s"]["matchedNodes"] == ["h1", "h2"]
    assert out["a100s"]["matchedNodes"] == ["a1"]
    condition = _condition(out["h100s"])
    assert (condition["status"], condition["reason"]) == ("False", "NoConflict")
    assert condition["observedGeneration"] == 2


def test_tie_at_the_top_priority_is_a_conflict_on_both() -> None:
    out = _patches(_policy("one", 5, gpu="h100"), _policy("two", 5), _policy("low", 1, gpu="h100"))
    for name in ("one", "two"):
        condition = _condition(out[name])
        assert (condition["status"], condition["reason"]) == ("True", "Conflict")
        assert "policies one, two all select node h1 with priority 5" in condition["message"]
        assert condition["message"].endswith("the same holds on h2")
    assert _condition(out["low"])["status"] == "False"  # outranked, not tied
    assert out["low"]["matchedNodes"] == ["h1", "h2"]


def test_nothing_to_write_when_status_is_current() -> None:
    first = _policy("h100s", gpu="h100")
    status = _patches(first)["h100s"]
    current = {**first, "status": status}
    assert _patches(current) == {}
    # A node joining changes matchedNodes, and only that is written.
    NODES["h3"] = node_record(node("h3", {"gpu": "h100"}))
    try:
        again = _patches(current)["h100s"]
    finally:
        del NODES["h3"]
    assert again["matchedNodes"] == ["h1", "h2", "h3"]
    assert again["conditions"] == status["conditions"]  # lastTransitionTime kept


def test_invalid_policy_is_left_alone() -> None:
    broken = _policy("broken")
    broken["spec"]["priority"] = "high"
    assert _patches(broken, _policy("fine")).keys() == {"fine"}
