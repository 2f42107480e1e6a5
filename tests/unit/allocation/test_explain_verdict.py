"""The explanation's verdict skips the search on nodes short of free matching devices; it must
be the allocator's verdict on every node all the same."""

from __future__ import annotations

from typing import Any

from allocation_builders import DRIVER, claim, device_class, holding, pool_slices, request
from hypothesis import given, settings
from hypothesis import strategies as st

from flexgpu.driver.allocation import Node
from flexgpu.driver.allocation.anywhere import allocate_anywhere
from flexgpu.driver.allocation.explain import explain_claim
from flexgpu.driver.allocation.state import allocated_state

A = f'device.attributes["{DRIVER}"]'
NODES = [Node(f"n{i}", {"kubernetes.io/hostname": f"n{i}", "zone": "ab"[i % 2]}) for i in range(3)]


def _node_devices(node: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two partitionable GPUs (whole or two halves, by counters) and a plain one."""
    devices: list[dict[str, Any]] = []
    counters = []
    for g in range(2):
        counters.append({"name": f"g{g}", "counters": {"s": {"value": "2"}}})
        for name, used, kind in (
            (f"g{g}", 2, "gpu"),
            (f"g{g}-a", 1, "part"),
            (f"g{g}-b", 1, "part"),
        ):
            devices.append(
                {
                    "name": name,
                    "attributes": {"kind": {"string": kind}, "gpu": {"int": g + 2 * node}},
                    "capacity": {"memory": {"value": f"{10 * used}Gi"}},
                    "consumesCounters": [
                        {"counterSet": f"g{g}", "counters": {"s": {"value": str(used)}}}
                    ],
                }
            )
    devices.append(
        {
            "name": "plain",
            "attributes": {"kind": {"string": "gpu"}, "gpu": {"int": 9}},
            "capacity": {"memory": {"value": "20Gi"}},
        }
    )
    return devices, counters


NAMES = ["g0", "g0-a", "g0-b", "g1", "g1-a", "g1-b", "plain"]
SELECTORS = ["", f'{A}.kind == "part"', f'{A}.kind == "gpu"', f"{A}.gpu < 2"]


@settings(max_examples=150, deadline=None)
@given(
    held=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(NAMES)), max_size=6, unique=True),
    wants=st.lists(
        st.tuples(st.integers(1, 3), st.sampled_from(SELECTORS)), min_size=1, max_size=2
    ),
    usable=st.sets(st.integers(0, 2)),
)
def test_explanation_verdict_is_the_allocators_on_every_node(
    held: list[tuple[int, str]], wants: list[tuple[int, str]], usable: set[int]
) -> None:
    slices = []
    for i, node in enumerate(NODES):
        devices, counters = _node_devices(i)
        slices += pool_slices(node.name, devices, counters=counters)
    others = [holding(f"h{k}", name, node=f"n{n}") for k, (n, name) in enumerate(held)]
    target = claim(
        *(request(f"r{k}", count, *([sel] if sel else [])) for k, (count, sel) in enumerate(wants))
    )
    classes = device_class()
    usable_nodes = [f"n{i}" for i in sorted(usable)]
    explained = explain_claim(
        target, slices, classes, [*others, target], NODES, usable_nodes=usable_nodes
    )
    state = allocated_state([*others], skip=[target.key])
    searched = allocate_anywhere(
        [target], [n for n in NODES if n.name in usable_nodes], slices, classes, state
    )
    assert explained.outcome == searched.outcome
    assert list(explained.allocatable_nodes) == searched.allocatable_nodes
