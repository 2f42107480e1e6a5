"""The one model of an allocation result, shared by the kubelet plugin and the allocator."""

from __future__ import annotations

from fractions import Fraction

import pytest

from flexgpu.driver.allocation import parse_claim as parse_allocation_claim
from flexgpu.driver.claim_results import (
    ClaimResultError,
    parse_allocated_device,
    parse_consumed_capacity,
)
from flexgpu.kubelet_plugin.claims.claim_source import parse_claim as parse_plugin_claim

RESULT = {
    "request": "gpu/l4",
    "driver": "gpu.flexgpu.dev",
    "pool": "node-a",
    "device": "gpu-1",
    "shareID": "abc",
    "consumedCapacity": {"memory": "1.5Gi", "compute": 30},
}


def test_a_result_keeps_each_quantity_as_written_and_exactly() -> None:
    device = parse_allocated_device(RESULT)
    assert (device.request, device.base_request, device.share_id) == ("gpu/l4", "gpu", "abc")
    assert device.consumed_capacity is not None
    assert device.consumed_capacity["memory"].value == Fraction(3 * 2**29)
    assert device.consumed_texts() == {"memory": "1.5Gi", "compute": "30"}


def test_absent_consumed_capacity_is_none_and_an_empty_share_id_is_no_share() -> None:
    device = parse_allocated_device({**RESULT, "consumedCapacity": None, "shareID": ""})
    assert device.consumed_capacity is None and device.share_id is None
    assert device.consumed_texts() == {}


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ({"memory": "8GB"}, "results[3].consumedCapacity.memory: '8GB' is not a Kubernetes"),
        (["8Gi"], "results[3].consumedCapacity: expected an object, got list"),
    ],
)
def test_a_malformed_consumed_capacity_names_the_field(consumed: object, message: str) -> None:
    with pytest.raises(ClaimResultError, match=r"^" + message.replace("[", r"\[")):
        parse_consumed_capacity(consumed, "results[3].consumedCapacity")


def test_both_claim_parsers_build_the_same_result() -> None:
    claim = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
        "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [RESULT]}}},
    }
    allocation = parse_allocation_claim(claim).allocation
    assert allocation is not None
    assert parse_plugin_claim(claim).devices == allocation == (parse_allocated_device(RESULT),)
