"""The chart's GPU clearing values: eviction is off unless asked for, and only then does the
controller get the flags, the right to evict (pods/eviction, never delete on pods) and to read
PodDisruptionBudgets (its consent), never to write them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from flexgpu.controller.main import config_from_args, parse_args
from tests.unit.test_chart import CHART, find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py


def _args(docs: list[dict[str, Any]]) -> list[str]:
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    return list(spec["containers"][0]["args"])


def _pod_rights(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    rules = find(docs, "ClusterRole", "controller")["rules"]
    return {
        (resource, verb)
        for rule in rules
        if "" in rule["apiGroups"]
        for resource in rule["resources"]
        if resource.startswith("pods")
        for verb in rule["verbs"]
    }


def _budget_rights(docs: list[dict[str, Any]]) -> set[str]:
    rules = find(docs, "ClusterRole", "controller")["rules"]
    return {
        verb
        for rule in rules
        if "policy" in rule["apiGroups"] and "poddisruptionbudgets" in rule["resources"]
        for verb in rule["verbs"]
    }


def test_eviction_is_off_by_default_with_no_flags_and_no_right_to_evict(helm: Path) -> None:
    docs = render(helm)
    assert _budget_rights(docs) == set()
    assert not [a for a in _args(docs) if a.startswith("--clearing-evict")]
    assert _pod_rights(docs) == {("pods", "get"), ("pods", "list"), ("pods", "watch")}
    config = config_from_args(parse_args(_args(docs)))
    assert config.clearing_evict_after_s is None


def test_eviction_on_passes_its_values_and_grants_only_create_on_pods_eviction(
    helm: Path,
) -> None:
    docs = render(
        helm,
        "controller.clearing.eviction.enabled=true",
        "controller.clearing.eviction.after=15m",
        "controller.clearing.eviction.maxInFlight=3",
    )
    config = config_from_args(parse_args(_args(docs)))
    assert (config.clearing_evict_after_s, config.clearing_evict_max_in_flight) == (900.0, 3)
    assert _pod_rights(docs) == {
        ("pods", "get"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods/eviction", "create"),
    }
    assert _budget_rights(docs) == {"get", "list", "watch"}
    # Without clearing there is nothing to evict for: neither flags nor the right.
    off = render(
        helm, "controller.clearing.enabled=false", "controller.clearing.eviction.enabled=true"
    )
    assert not [a for a in _args(off) if a.startswith("--clearing")]
    assert ("pods/eviction", "create") not in _pod_rights(off)
    assert _budget_rights(off) == set()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("controller.clearing.eviction.maxInFlight=0", "/controller/clearing/eviction/maxInFlight"),
        ("controller.clearing.eviction.after=soon", "/controller/clearing/eviction/after"),
        ("controller.clearing.eviction.often=1", "additional properties 'often' not allowed"),
    ],
)
def test_bad_eviction_values_fail_naming_the_field(helm: Path, value: str, message: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr
