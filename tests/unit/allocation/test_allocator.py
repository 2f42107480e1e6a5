"""The allocator's rules, one by one, on small hand-built pools."""

from __future__ import annotations

from typing import Any

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

from flexgpu.driver.allocation import Node, allocate, allocated_state
from flexgpu.driver.allocation.model import ResourceClaim, ResourceSlice

A = f'device.attributes["{DRIVER}"]'


def run(
    target: ResourceClaim,
    slices: list[ResourceSlice],
    others: tuple[ResourceClaim, ...] = (),
    node: Node = NODE,
    classes: Any = None,
) -> Any:
    return allocate(
        [target], node, slices, classes or device_class(), allocated_state(list(others))
    )


def picked(verdict: Any) -> list[str]:
    assert verdict.outcome == "allocatable", verdict.reason
    return [d.device for d in verdict.devices[0]]


def test_first_fit_in_device_order_and_counts() -> None:
    slices = pool_slices("n1", [device(f"g{i}") for i in range(3)])
    assert picked(run(claim(request(count=2)), slices)) == ["g0", "g1"]
    assert run(claim(request(count=4)), slices).outcome == "unallocatable"


def test_allocated_devices_are_taken() -> None:
    slices = pool_slices("n1", [device("g0"), device("g1")])
    assert picked(run(claim(request()), slices, (holding("other", "g0"),))) == ["g1"]
    full = (holding("a", "g0"), holding("b", "g1"))
    assert run(claim(request()), slices, full).outcome == "unallocatable"


def test_request_and_class_selectors() -> None:
    slices = pool_slices("n1", [device("g0", model="l4"), device("g1", "80Gi", model="h100")])
    big = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) > 0'
    assert picked(run(claim(request("r", 1, big)), slices)) == ["g1"]
    only_l4 = device_class("gpu", f'{A}.model == "l4"')
    assert run(claim(request("r", 1, big)), slices, classes=only_l4).outcome == "unallocatable"


def test_backtracking_finds_a_matching_pair() -> None:
    devices = [device("g0", numa=0), device("g1", numa=1), device("g2", numa=1)]
    target = claim(request(count=2), constraints=[{"matchAttribute": f"{DRIVER}/numa"}])
    assert picked(run(target, pool_slices("n1", devices))) == ["g1", "g2"]


def test_distinct_attribute_and_constraint_scope() -> None:
    devices = [device("g0", numa=0), device("g1", numa=0), device("g2", numa=1)]
    distinct = [{"distinctAttribute": f"{DRIVER}/numa"}]
    assert picked(
        run(claim(request(count=2), constraints=distinct), pool_slices("n1", devices))
    ) == [
        "g0",
        "g2",
    ]
    three = claim(request(count=3), constraints=distinct)
    assert run(three, pool_slices("n1", devices)).outcome == "unallocatable"
    # A constraint naming only request "a" leaves request "b" unconstrained.
    scoped = claim(
        request("a", 2),
        request("b", 1),
        constraints=[{"distinctAttribute": f"{DRIVER}/numa", "requests": ["a"]}],
    )
    assert picked(run(scoped, pool_slices("n1", devices))) == ["g0", "g2", "g1"]


def test_constraint_on_missing_attribute_never_holds() -> None:
    target = claim(request(), constraints=[{"matchAttribute": f"{DRIVER}/numa"}])
    assert run(target, pool_slices("n1", [device("g0")])).outcome == "unallocatable"


def test_allocation_mode_all() -> None:
    devices = [device("g0", model="l4"), device("g1", model="h100"), device("g2", model="l4")]
    all_l4 = claim(request("r", 1, f'{A}.model == "l4"', allocationMode="All"))
    assert picked(run(all_l4, pool_slices("n1", devices))) == ["g0", "g2"]
    assert run(all_l4, pool_slices("n1", devices), (holding("o", "g2"),)).outcome == (
        "unallocatable"
    )
    none = claim(request("r", 1, f'{A}.model == "t4"', allocationMode="All"))
    assert run(none, pool_slices("n1", devices)).outcome == "unallocatable"


def test_all_mode_errors_on_incomplete_pool_and_broken_constraint() -> None:
    incomplete = pool_slices("n1", [device("g0")], count=2)
    all_devices = claim(request(allocationMode="All"))
    verdict = run(all_devices, incomplete)
    assert verdict.outcome == "error" and "being updated" in verdict.reason
    devices = [device("g0", numa=0), device("g1", numa=1)]
    mixed = claim(request(allocationMode="All"), constraints=[{"matchAttribute": f"{DRIVER}/numa"}])
    assert run(mixed, pool_slices("n1", devices)).outcome == "error"


def test_incomplete_pools_and_old_generations_are_ignored() -> None:
    assert run(claim(request()), pool_slices("n1", [device("g0")], count=2)).outcome == (
        "unallocatable"
    )
    old = pool_slices("n1", [device("old")], generation=1)
    new = pool_slices("n1", [device("new")], generation=2)
    assert picked(run(claim(request()), old + new)) == ["new"]


def test_node_visibility() -> None:
    other = Node("n2", {"zone": "b"})
    local = pool_slices("n1", [device("g0")])
    assert run(claim(request()), local, node=other).outcome == "unallocatable"
    zonal = {
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
            ]
        }
    }
    shared = pool_slices("zone-a", [device("g0")], extra=zonal)
    assert picked(run(claim(request()), shared)) == ["g0"]
    assert run(claim(request()), shared, node=other).outcome == "unallocatable"
    everywhere = pool_slices("all", [device("g0")], extra={"allNodes": True})
    assert picked(run(claim(request()), everywhere, node=other)) == ["g0"]


def test_invalid_pool_is_skipped() -> None:
    slices = pool_slices("n1", [device("g0"), device("g0")])
    verdict = run(claim(request()), slices)
    assert verdict.outcome == "unallocatable" and "duplicate device name" in verdict.reason


def test_first_available_tries_alternatives_in_order() -> None:
    slices = pool_slices("n1", [device("g0", model="l4"), device("g1", model="l4")])
    subs = [
        {
            "name": "big",
            "deviceClassName": "gpu",
            "count": 1,
            "selectors": [{"cel": {"expression": f'{A}.model == "h100"'}}],
        },
        {"name": "small", "deviceClassName": "gpu", "count": 2},
    ]
    verdict = run(claim({"name": "r", "firstAvailable": subs}), slices)
    assert [d.request for d in verdict.devices[0]] == ["r/small", "r/small"]
    subs[1]["count"] = 3
    assert run(claim({"name": "r", "firstAvailable": subs}), slices).outcome == "unallocatable"


def test_taints_and_tolerations() -> None:
    tainted = device("g0")
    tainted["taints"] = [{"key": "maint", "value": "yes", "effect": "NoSchedule"}]
    soft = device("g1")
    soft["taints"] = [{"key": "maint", "value": "yes", "effect": "PreferNoSchedule"}]
    slices = pool_slices("n1", [tainted, soft])
    assert picked(run(claim(request()), slices)) == ["g1"]
    assert run(claim(request(count=2)), slices).outcome == "unallocatable"
    for toleration in (
        {"key": "maint", "operator": "Exists"},
        {"key": "maint", "value": "yes", "effect": "NoSchedule"},
        {"operator": "Exists"},
    ):
        assert picked(run(claim(request("r", 2, tolerations=[toleration])), slices)) == ["g0", "g1"]
    wrong = [
        {"key": "maint", "value": "no"},
        {"key": "maint", "operator": "Exists", "effect": "NoExecute"},
    ]
    assert run(claim(request("r", 2, tolerations=wrong)), slices).outcome == "unallocatable"


def _partitions() -> list[ResourceSlice]:
    def part(name: str, gi: int) -> dict[str, Any]:
        d = device(name, f"{gi}Gi")
        d["consumesCounters"] = [{"counterSet": "gpu-0", "counters": {"mem": {"value": f"{gi}Gi"}}}]
        return d

    counters = [{"name": "gpu-0", "counters": {"mem": {"value": "80Gi"}}}]
    return pool_slices(
        "n1", [part("full", 80), part("half-0", 40), part("half-1", 40)], counters=counters
    )


def test_shared_counters_prevent_overlapping_partitions() -> None:
    slices = _partitions()
    assert picked(run(claim(request(count=2)), slices)) == ["half-0", "half-1"]
    assert run(claim(request(count=3)), slices).outcome == "unallocatable"
    # The full GPU is free as a device, but an allocated half spent its counters.
    full_only = claim(
        request("r", 1, 'device.capacity["gpu.example.com"].memory == quantity("80Gi")')
    )
    assert run(full_only, slices, (holding("o", "half-1"),)).outcome == "unallocatable"
    assert picked(run(full_only, slices)) == ["full"]


def test_admin_access_ignores_allocations_but_not_counters() -> None:
    slices = pool_slices("n1", [device("g0"), device("g1")])
    taken = (holding("a", "g0"), holding("b", "g1"))
    admin = claim(request("r", 2, adminAccess=True))
    assert picked(run(admin, slices, taken)) == ["g0", "g1"]
    # An admin-access result holds nothing for others.
    watched = (holding("a", "g0", adminAccess=True),)
    assert picked(run(claim(request(count=2)), slices, watched)) == ["g0", "g1"]
    # The full partition's counters are spent by the allocated half, admin access or not.
    full = claim(
        request("r", 1, f'device.capacity["{DRIVER}"].memory == quantity("80Gi")', adminAccess=True)
    )
    assert run(full, _partitions(), (holding("o", "half-0"),)).outcome == "unallocatable"


def _shared(policy: dict[str, Any] | None = None) -> list[ResourceSlice]:
    memory: dict[str, Any] = {"value": "40Gi"}
    if policy:
        memory["requestPolicy"] = policy
    d = {"name": "s0", "allowMultipleAllocations": True, "capacity": {"memory": memory}}
    return pool_slices("n1", [d])


def share(amount: str) -> dict[str, Any]:
    return request("r", 1, capacity={"requests": {"memory": amount}})


def test_consumable_capacity_shares_a_device() -> None:
    slices = _shared()
    used = (holding("a", "s0", shareID="u1", consumedCapacity={"memory": "30Gi"}),)
    verdict = run(claim(share("10Gi")), slices, used)
    assert verdict.devices[0][0].shared and verdict.devices[0][0].consumed_capacity == {
        "memory": 10 * 2**30
    }
    assert run(claim(share("11Gi")), slices, used).outcome == "unallocatable"
    # Two shares of the same device within one claim add up.
    assert (
        run(claim(share("20Gi"), {**share("20Gi"), "name": "s"}), slices).outcome == "allocatable"
    )
    assert run(claim(share("20Gi"), {**share("21Gi"), "name": "s"}), slices).outcome == (
        "unallocatable"
    )
    # Asking for a capacity the device does not have rules it out.
    other = request("r", 1, capacity={"requests": {"cores": "1"}})
    assert run(claim(other), slices).outcome == "unallocatable"
    # Without a request and without a default, a share takes the whole capacity.
    assert run(claim(request()), slices, used).outcome == "unallocatable"


def test_request_policies_round_up() -> None:
    stepped = _shared({"default": "8Gi", "validRange": {"min": "4Gi", "step": "4Gi"}})
    verdict = run(claim(share("5Gi")), stepped)
    assert verdict.devices[0][0].consumed_capacity == {"memory": 8 * 2**30}
    used = (holding("a", "s0", shareID="u", consumedCapacity={"memory": "32Gi"}),)
    assert run(claim(share("5Gi")), stepped, used).outcome == "allocatable"
    assert run(claim(share("9Gi")), stepped, used).outcome == "unallocatable"
    capped = _shared({"default": "8Gi", "validRange": {"min": "4Gi", "max": "16Gi"}})
    assert run(claim(share("17Gi")), capped).outcome == "unallocatable"
    values = _shared({"default": "10Gi", "validValues": ["10Gi", "20Gi"]})
    assert run(claim(share("11Gi")), values).devices[0][0].consumed_capacity == {
        "memory": 20 * 2**30
    }
    assert run(claim(share("21Gi")), values).outcome == "unallocatable"


def test_selector_runtime_error_is_an_error_verdict() -> None:
    slices = pool_slices("n1", [device("g0"), device("g1", numa=1)])
    verdict = run(claim(request("r", 1, f"{A}.numa == 1")), slices)
    assert verdict.outcome == "error" and "g0" in verdict.reason
    # A device taken by someone else is never evaluated, so no error arises from it.
    assert picked(run(claim(request("r", 1, f"{A}.numa == 1")), slices, (holding("o", "g0"),))) == [
        "g1"
    ]


def test_missing_class_and_result_limit() -> None:
    slices = pool_slices("n1", [device("g0")])
    verdict = run(claim(request()), slices, classes=device_class("other"))
    assert verdict.outcome == "unallocatable" and "does not exist" in verdict.reason
    assert run(claim(request(count=33)), slices).outcome == "error"
