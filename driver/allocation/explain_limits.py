"""What a node could ever give one request: the ceiling an explanation states when a claim
asks for more devices than any node has (or than share one value of a matchAttribute
constraint), whatever else is allocated."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from flexgpu.driver.allocation.constraints import lookup_attribute
from flexgpu.driver.allocation.model import Device

# Reasons that end when other claims do: a device held for one of them still counts toward
# what a node could ever give the request.
HELD_OR_FREE: Final = frozenset({None, "allocated", "capacity_used", "counters_spent"})


def count_serving(
    nodes: Sequence[str],
    device: Device,
    driver: str,
    per_node: dict[str, int],
    per_value: dict[str, dict[tuple[str, str], int]],
) -> None:
    for node_name in nodes:
        per_node[node_name] = per_node.get(node_name, 0) + 1
        for attribute, groups in per_value.items():
            value = lookup_attribute(device, driver, attribute)
            if value is None or value.is_list:
                continue
            key = (node_name, f"{value.kind}:{value.value}")
            groups[key] = groups.get(key, 0) + 1


def largest_match(per_value: dict[str, dict[tuple[str, str], int]]) -> tuple[str, int] | None:
    """The constraint that allows the fewest devices together, with that number."""
    sizes = [(max(groups.values(), default=0), a) for a, groups in per_value.items()]
    if not sizes:
        return None
    size, attribute = min(sizes)
    return attribute, size
