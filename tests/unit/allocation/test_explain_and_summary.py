"""Explanations name what rules devices out; the capacity summary counts free devices."""

from __future__ import annotations

from allocation_builders import (
    DRIVER,
    NODE,
    claim,
    device,
    device_class,
    holding,
    pool_slices,
    request,
)

from flexgpu.driver.allocation import Node
from flexgpu.driver.allocation.allocator import SelectorCache
from flexgpu.driver.allocation.describe import format_quantity
from flexgpu.driver.allocation.explain import explain_claim
from flexgpu.driver.allocation.pools import SliceIndex
from flexgpu.driver.allocation.summary import capacity_summary

A = f'device.attributes["{DRIVER}"]'
BIG = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0'


def _cluster() -> list:
    devices = [
        device("h0", "80Gi", productName="H100", type="gpu"),
        device("h1", "80Gi", productName="H100", type="gpu"),
        device("l0", "24Gi", productName="L4", type="gpu"),
        device("l1", "24Gi", productName="L4", type="gpu"),
    ]
    return pool_slices("n1", devices)


def test_all_matching_devices_allocated_and_near_misses_named() -> None:
    others = [holding("a", "h0"), holding("b", "h1")]
    target = claim(request("gpus", 1, BIG))
    result = explain_claim(target, _cluster(), device_class(), [*others, target], [NODE])
    assert result.outcome == "unallocatable" and result.allocatable_nodes == ()
    (diag,) = result.requests
    assert (diag.in_class, diag.matching, diag.free) == (4, 2, 0)
    assert diag.excluded["allocated"] == 2 and diag.excluded["not_selected"] == 2
    assert diag.holders == ("ns/a", "ns/b")
    assert "2 L4 with 24Gi" in diag.near_misses
    assert "2 allocated to other claims" in result.message and "L4 with 24Gi" in result.message


def test_allocatable_claim_says_where() -> None:
    target = claim(request("gpus", 2))
    result = explain_claim(target, _cluster(), device_class(), [target], [NODE])
    assert result.outcome == "allocatable" and result.allocatable_nodes == ("n1",)
    assert "can be allocated on n1" in result.message


def test_unusable_nodes_taints_and_constraints() -> None:
    elsewhere = Node("n2")
    tainted = device("t0", productName="H100")
    tainted["taints"] = [{"key": "k", "value": "v", "effect": "NoExecute"}]
    slices = (
        _cluster()
        + pool_slices("n2", [device("x0", productName="H100")])
        + pool_slices("n3", [tainted])
    )
    nodes = [NODE, elsewhere, Node("n3")]
    target = claim(request("gpus", 6))
    result = explain_claim(
        target, slices, device_class(), [target], nodes, usable_nodes=["n1", "n3"]
    )
    (diag,) = result.requests
    assert diag.excluded["unreachable"] == 1 and diag.excluded["tainted"] == 1 and diag.free == 4
    paired = claim(request("gpus", 2), constraints=[{"matchAttribute": f"{DRIVER}/numa"}])
    result = explain_claim(paired, _cluster(), device_class(), [paired], [NODE])
    assert result.outcome == "unallocatable" and "constraints" in result.message


def test_selector_error_and_missing_class() -> None:
    target = claim(request("gpus", 1, f"{A}.numa == 0"))
    result = explain_claim(target, _cluster(), device_class(), [target], [NODE])
    assert result.outcome == "error"
    assert result.requests[0].excluded["selector_error"] == 4 and "has()" in result.message
    missing = explain_claim(target, _cluster(), device_class("other"), [target], [NODE])
    assert missing.outcome == "unallocatable" and "does not exist" in missing.message


def test_capacity_summary_counts_free_devices_and_shares() -> None:
    shared = {
        "name": "s0",
        "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "H200"}},
        "capacity": {"memory": {"value": "140Gi"}},
    }
    slices = _cluster() + pool_slices("n2", [shared])
    claims = [
        holding("a", "h0"),
        holding("b", "s0", node="n2", shareID="x", consumedCapacity={"memory": "40Gi"}),
    ]
    rows = {(r.type, r.product): r for r in capacity_summary(slices, claims, driver=DRIVER)}
    assert (rows[("gpu", "H100")].total, rows[("gpu", "H100")].free) == (2, 1)
    assert (rows[("gpu", "L4")].total, rows[("gpu", "L4")].free) == (2, 2)
    h200 = rows[("gpu", "H200")]
    assert h200.free == 0 and h200.shareable["memory"] == (100 * 2**30, 140 * 2**30)
    incomplete = pool_slices("n3", [device("z")], count=2)
    assert capacity_summary(incomplete, [], driver=DRIVER) == []


def test_format_quantity() -> None:
    assert format_quantity(24 * 2**30) == "24Gi"
    assert format_quantity(100) == "100"
    assert format_quantity(__import__("fractions").Fraction(1, 10)) == "100m"


def test_explanations_sharing_one_index_match_fresh_ones() -> None:
    """What an explanation keeps with the slice index for a kind of request (selector, taint
    and size checks) must not leak into requests that differ in selectors, tolerations or
    capacity: each explanation over a shared index equals one over a fresh index."""
    tainted = device("t0", "80Gi", productName="H100", type="gpu")
    tainted["taints"] = [{"key": "k", "value": "v", "effect": "NoSchedule"}]
    shared = {
        "name": "s0",
        "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "gpu"}, "productName": {"string": "H200"}},
        "capacity": {"memory": {"value": "140Gi"}},
    }
    slices = _cluster() + pool_slices("n2", [tainted, shared])
    nodes = [NODE, Node("n2")]
    others = [
        holding("a", "h0"),
        holding("b", "s0", node="n2", shareID="x", consumedCapacity={"memory": "120Gi"}),
    ]
    tolerate = [{"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"}]
    kinds = [
        request("gpus", 3),
        request("gpus", 3, BIG),
        request("gpus", 3, tolerations=tolerate),
        request("gpus", 1, capacity={"requests": {"memory": "30Gi"}}),
        request("gpus", 1, capacity={"requests": {"memory": "10Gi"}}),
        request("gpus", 1, capacity={"requests": {"memory": "100Gi"}}),
    ]
    index, selectors = SliceIndex(slices), SelectorCache()
    seen = set()
    for body in kinds + kinds:
        target = claim(body)
        everyone = [*others, target]
        shared_result = explain_claim(
            target, slices, device_class(), everyone, nodes, selectors=selectors, index=index
        )
        fresh = explain_claim(target, slices, device_class(), everyone, nodes)
        assert shared_result == fresh
        seen.add(tuple(sorted((r, n) for r, n in fresh.requests[0].excluded.items() if n)))
    # The kinds really differ in what rules devices out (else the test proves nothing).
    assert len(seen) == len(kinds)


def test_more_devices_than_one_node_has_is_called_never_fitting() -> None:
    """Five GPUs from a cluster of one 4-GPU node: the explanation says no node ever has that
    many, rather than only counting what is free now."""
    target = claim(request("gpus", 5))
    result = explain_claim(target, _cluster(), device_class(), [target], [NODE])
    (diag,) = result.requests
    assert diag.most_on_one_node == 4 and diag.free == 4
    assert "no node the pod may use has more than 4 of them even with nothing else" in (
        result.message
    )


def test_held_devices_count_toward_what_a_node_could_give() -> None:
    """Devices held by other claims still count toward the ceiling: only a structural limit
    is called never fitting."""
    others = [holding("a", "h0"), holding("b", "h1"), holding("d", "l0")]
    target = claim(request("gpus", 3))
    result = explain_claim(target, _cluster(), device_class(), [*others, target], [NODE])
    (diag,) = result.requests
    assert (diag.free, diag.most_on_one_node) == (1, 4)
    assert "ask for at most" not in result.message
