"""Status helpers: conditions, the node's Applied condition, merge patches of one node's entry."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.node_policy import (
    APPLIED_CONDITION,
    Condition,
    ConditionStatus,
    GpuMode,
    GpuModeSpec,
    GpuStatus,
    NodeStatus,
    PolicyReason,
    format_time,
    gpu_status,
    merge_patch,
    node_condition,
    node_status_patch,
    node_status_removal,
    set_condition,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def _gpu(
    reason: PolicyReason, message: str = "", layout: dict[str, int] | None = None
) -> GpuStatus:
    return GpuStatus(mode=GpuMode.MIG, migLayout=layout, reason=reason, message=message)


def test_format_time_is_utc_whole_seconds() -> None:
    assert format_time(T0) == "2025-01-01T00:00:00Z"
    plus_two = timezone(timedelta(hours=2))
    assert (
        format_time(datetime(2025, 1, 1, 2, 0, 0, 999, tzinfo=plus_two)) == "2025-01-01T00:00:00Z"
    )


def test_set_condition_keeps_the_transition_time_while_the_status_holds() -> None:
    first = set_condition(
        [],
        APPLIED_CONDITION,
        status=ConditionStatus.FALSE,
        reason="Pending",
        message="busy",
        now=T0,
    )
    assert first == [
        Condition(
            type="Applied",
            status=ConditionStatus.FALSE,
            reason="Pending",
            message="busy",
            lastTransitionTime="2025-01-01T00:00:00Z",
        )
    ]
    same = set_condition(
        first, "Applied", status=ConditionStatus.FALSE, reason="InvalidLayout", message="x", now=T1
    )
    assert same[0].lastTransitionTime == "2025-01-01T00:00:00Z"
    assert same[0].reason == "InvalidLayout"
    flipped = set_condition(
        same,
        "Applied",
        status=ConditionStatus.TRUE,
        reason="Applied",
        message="",
        now=T1,
        observed_generation=4,
    )
    assert flipped[0].lastTransitionTime == "2025-01-01T00:05:00Z"
    assert flipped[0].observedGeneration == 4


def test_set_condition_leaves_other_types_in_place() -> None:
    conditions = set_condition(
        [], "Ready", status=ConditionStatus.TRUE, reason="Ok", message="", now=T0
    )
    conditions = set_condition(
        conditions, "Applied", status=ConditionStatus.TRUE, reason="Applied", message="", now=T0
    )
    conditions = set_condition(
        conditions, "Ready", status=ConditionStatus.FALSE, reason="Down", message="", now=T1
    )
    assert [(c.type, c.status.value) for c in conditions] == [
        ("Ready", "False"),
        ("Applied", "True"),
    ]


def test_condition_fields_are_validated() -> None:
    with pytest.raises(ValidationError):
        Condition(
            type="Applied",
            status=ConditionStatus.TRUE,
            reason="not camel",
            lastTransitionTime="2025-01-01T00:00:00Z",
        )
    with pytest.raises(ValidationError):
        Condition(
            type="Applied",
            status=ConditionStatus.TRUE,
            reason="Applied",
            lastTransitionTime="yesterday",
        )


def test_node_condition_applied_when_every_gpu_is() -> None:
    gpus = {"0": _gpu(PolicyReason.APPLIED), "1": _gpu(PolicyReason.APPLIED)}
    assert node_condition(gpus) == (
        ConditionStatus.TRUE,
        PolicyReason.APPLIED,
        "2 GPUs are as the policy asks",
    )
    assert node_condition({"0": _gpu(PolicyReason.APPLIED)})[2] == "1 GPU is as the policy asks"


def test_node_condition_reports_the_worst_reason_with_its_gpus() -> None:
    gpus = {
        "10": _gpu(PolicyReason.PENDING, "3 MIG devices in use"),
        "2": _gpu(PolicyReason.INVALID_LAYOUT, "does not fit"),
        "1": _gpu(PolicyReason.PENDING, "in use"),
        "0": _gpu(PolicyReason.INVALID_LAYOUT),
    }
    assert node_condition(gpus) == (
        ConditionStatus.FALSE,
        PolicyReason.INVALID_LAYOUT,
        "GPU 0: InvalidLayout; GPU 2: does not fit",
    )
    del gpus["2"], gpus["0"]
    assert node_condition(gpus) == (
        ConditionStatus.FALSE,
        PolicyReason.PENDING,
        "GPU 1: in use; GPU 10: 3 MIG devices in use",
    )
    assert node_condition(gpus, "tie")[1:] == (PolicyReason.CONFLICT, "tie")


def test_gpu_status_from_a_mode_spec(h100: GpuInfo) -> None:
    spec = GpuModeSpec(mode=GpuMode.MIG, entry=0, mig_layout={"1g.10gb": 7})
    status = gpu_status(spec, h100, PolicyReason.PENDING, "busy", {"3g.40gb": 2})
    assert status.model_dump(mode="json", exclude_none=True) == {
        "mode": "MIG",
        "migLayout": {"3g.40gb": 2},
        "productName": "NVIDIA H100 80GB HBM3",
        "reason": "Pending",
        "message": "busy",
    }


@pytest.fixture
def h100() -> GpuInfo:
    from policy_builders import h100 as first_h100

    return first_h100()


def test_merge_patch_nulls_what_is_gone() -> None:
    assert merge_patch(
        {"a": 1, "b": {"c": 1, "d": 2}, "l": [1]}, {"a": 1, "b": {"c": 3}, "l": [2]}
    ) == {
        "b": {"c": 3, "d": None},
        "l": [2],
    }
    assert merge_patch({"a": 1}, {"a": 1}) == {}
    assert merge_patch(1, {"a": 1}) == {"a": 1}


def _entry(layout: dict[str, int], reason: PolicyReason = PolicyReason.APPLIED) -> NodeStatus:
    return NodeStatus(
        observedGeneration=2,
        gpus={"0": _gpu(reason, layout=layout)},
        conditions=set_condition(
            [], "Applied", status=ConditionStatus.TRUE, reason="Applied", message="", now=T0
        ),
    )


def test_node_status_patch_touches_only_its_node() -> None:
    new = _entry({"1g.10gb": 7})
    assert node_status_patch("node-a", new) == {
        "status": {
            "nodes": {
                "node-a": {
                    "observedGeneration": 2,
                    "gpus": {
                        "0": {
                            "mode": "MIG",
                            "migLayout": {"1g.10gb": 7},
                            "reason": "Applied",
                            "message": "",
                        }
                    },
                    "conditions": [
                        {
                            "type": "Applied",
                            "status": "True",
                            "reason": "Applied",
                            "message": "",
                            "lastTransitionTime": "2025-01-01T00:00:00Z",
                        }
                    ],
                }
            }
        }
    }


def test_node_status_patch_against_the_last_read_entry_removes_stale_keys() -> None:
    old = _entry({"1g.10gb": 7})
    new = _entry({"3g.40gb": 2}, PolicyReason.APPLIED)
    patch = node_status_patch("node-a", new, old)
    assert patch == {
        "status": {
            "nodes": {"node-a": {"gpus": {"0": {"migLayout": {"1g.10gb": None, "3g.40gb": 2}}}}}
        }
    }


def test_node_status_removal() -> None:
    assert node_status_removal("node-a") == {"status": {"nodes": {"node-a": None}}}


def test_reason_values() -> None:
    assert [r.value for r in PolicyReason] == [
        "Applied",
        "Pending",
        "Unsupported",
        "InvalidLayout",
        "Conflict",
    ]
