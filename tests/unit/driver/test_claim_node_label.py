"""The claim node label: its value for any node name, which node a claim's allocation names,
the patch that keeps the label true, and when the controller's Lease lets nodes rely on it."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from flexgpu.driver.claim_node_label import (
    CLAIM_NODE_LABEL,
    CLOCK_SKEW_S,
    LABELS_LIVE_ANNOTATION,
    allocated_node,
    label_patch,
    labels_live,
    node_label_value,
    node_selector,
)
from flexgpu.driver.names import DRIVER_NAME

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def claim(*pools: tuple[str, str], labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A claim whose allocation has results of (driver, pool)."""
    results = [{"driver": d, "pool": p, "device": "gpu-0", "request": "r"} for d, p in pools]
    obj: dict[str, Any] = {"metadata": {"name": "c", "namespace": "ns", "uid": "u-1"}}
    if labels is not None:
        obj["metadata"]["labels"] = labels
    if pools:
        obj["status"] = {"allocation": {"devices": {"results": results}}}
    return obj


def test_a_node_name_that_is_a_label_value_is_used_as_it_is() -> None:
    assert node_label_value("gpu-node-1.zone-a") == "gpu-node-1.zone-a"
    assert node_selector("n1") == f"{CLAIM_NODE_LABEL}=n1"


@pytest.mark.parametrize("name", ["a" * 64, "node." * 40 + "x", "x" * 253])
def test_a_name_too_long_for_a_label_becomes_a_digest_that_is_a_label_value(name: str) -> None:
    value = node_label_value(name)
    assert value.startswith("sha256-") and len(value) == 63 and LABEL_VALUE.match(value)
    assert value == node_label_value(name)  # both sides compute the same
    assert value != node_label_value(name + "y")


def test_an_empty_node_name_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="node name: empty"):
        node_label_value("")


def test_the_allocated_node_is_the_pool_of_flexgpu_results_only() -> None:
    assert allocated_node(claim((DRIVER_NAME, "n1"))) == "n1"
    assert allocated_node(claim(("gpu.nvidia.com", "n9"), (DRIVER_NAME, "n2"))) == "n2"
    assert allocated_node(claim(("gpu.nvidia.com", "n9"))) is None
    assert allocated_node(claim()) is None


def test_the_patch_sets_changes_and_removes_the_label_and_carries_the_uid() -> None:
    assert label_patch(claim((DRIVER_NAME, "n1"))) == {
        "metadata": {"uid": "u-1", "labels": {CLAIM_NODE_LABEL: "n1"}}
    }
    assert label_patch(claim((DRIVER_NAME, "n1"), labels={CLAIM_NODE_LABEL: "n1"})) is None
    moved = label_patch(claim((DRIVER_NAME, "n2"), labels={CLAIM_NODE_LABEL: "n1"}))
    assert moved is not None and moved["metadata"]["labels"] == {CLAIM_NODE_LABEL: "n2"}
    freed = label_patch(claim(labels={CLAIM_NODE_LABEL: "n1", "app": "x"}))
    assert freed is not None and freed["metadata"]["labels"] == {CLAIM_NODE_LABEL: None}
    assert label_patch(claim(labels={"app": "x"})) is None  # never allocated: nothing to do


def lease(
    holder: str | None = "c-1", mark: str | None = "c-1", renewed: datetime = NOW
) -> dict[str, Any]:
    annotations = {LABELS_LIVE_ANNOTATION: mark} if mark else {}
    return {
        "metadata": {"name": "l", "annotations": annotations},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }


def test_labels_are_live_while_a_marked_holder_renews() -> None:
    assert labels_live(lease(), NOW + timedelta(seconds=5))
    assert labels_live(lease(), NOW + timedelta(seconds=15 + CLOCK_SKEW_S))


@pytest.mark.parametrize(
    ("why", "value"),
    [
        ("no lease", None),
        ("an older controller: no mark", lease(mark=None)),
        ("marked by the previous holder", lease(holder="c-2", mark="c-1")),
        ("released", lease(holder=None)),
        ("not renewed: controller down", lease(renewed=NOW - timedelta(seconds=31))),
        ("unreadable renew time", {**lease(), "spec": {**lease()["spec"], "renewTime": "x"}}),
    ],
)
def test_labels_are_not_relied_on(why: str, value: dict[str, Any] | None) -> None:
    assert not labels_live(value, NOW), why
