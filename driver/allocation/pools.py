"""The resource pools a node can allocate from, as the scheduler gathers them.

Only slices visible to the node count; within a pool only the highest generation does. A pool
with fewer slices than ``resourceSliceCount`` at that generation is incomplete (nothing in it is
allocated), one with duplicate device names or dangling counter references is invalid. Pools are
ordered by driver and pool name, slices by name: with first-fit search, order is priority.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from flexgpu.driver.allocation.model import Node, ResourceSlice
from flexgpu.driver.allocation.nodes import node_matches


@dataclass
class Pool:
    driver: str
    name: str
    incomplete: bool = False
    invalid_reason: str | None = None
    # Slices with devices the node can see, sorted by slice name.
    device_slices: list[ResourceSlice] = field(default_factory=list)
    # Every device slice of the pool at its generation (counters are shared across nodes).
    all_device_slices: list[ResourceSlice] = field(default_factory=list)
    counter_sets: dict[str, Mapping[str, Fraction]] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return not self.incomplete and self.invalid_reason is None

    @property
    def key(self) -> tuple[str, str]:
        return (self.driver, self.name)


def slice_visible(slc: ResourceSlice, node: Node) -> bool:
    if slc.node_name or slc.all_nodes or slc.node_selector is not None:
        return node_matches(node, slc.node_name, slc.all_nodes, slc.node_selector)
    if slc.per_device_node_selection:
        return any(
            node_matches(node, d.node_name, d.all_nodes, d.node_selector) for d in slc.devices
        )
    return False


def gather_pools(slices: Sequence[ResourceSlice], node: Node) -> list[Pool]:
    newest: dict[tuple[str, str], list[ResourceSlice]] = {}
    for slc in slices:
        if slc.node_name and slc.node_name != node.name:
            continue
        if not slice_visible(slc, node):
            continue
        key = (slc.driver, slc.pool)
        current = newest.get(key)
        if current is None or slc.generation > current[0].generation:
            newest[key] = [slc]
        elif slc.generation == current[0].generation:
            current.append(slc)

    pools: list[Pool] = []
    for (driver, name), visible in newest.items():
        generation = visible[0].generation
        everything = [
            s
            for s in slices
            if s.driver == driver and s.pool == name and s.generation == generation
        ]
        if len(visible) != visible[0].resource_slice_count:
            if any(
                s.driver == driver and s.pool == name and s.generation > generation for s in slices
            ):
                continue  # being replaced by a generation this node sees nothing of yet
            if len(everything) != visible[0].resource_slice_count:
                pools.append(Pool(driver, name, incomplete=True))
                continue
        pools.append(_build(driver, name, visible, everything))

    def order(pool: Pool) -> tuple[bool, str, str]:
        waits = any(d.binding_conditions for s in pool.device_slices for d in s.devices)
        return (waits, pool.driver, pool.name)

    return sorted(pools, key=order)


def _build(
    driver: str, name: str, visible: list[ResourceSlice], everything: list[ResourceSlice]
) -> Pool:
    pool = Pool(driver, name)
    counter_slices = sorted((s for s in everything if s.shared_counters), key=lambda s: s.name)
    pool.device_slices = sorted((s for s in visible if not s.shared_counters), key=lambda s: s.name)
    pool.all_device_slices = sorted(
        (s for s in everything if not s.shared_counters), key=lambda s: s.name
    )
    seen: set[str] = set()
    for slc in pool.device_slices:
        for device in slc.devices:
            if device.name in seen:
                pool.invalid_reason = f"duplicate device name {device.name}"
                return pool
            seen.add(device.name)
    for slc in counter_slices:
        for set_name, counters in slc.shared_counters:
            if set_name in pool.counter_sets:
                pool.invalid_reason = f"duplicate counter set name {set_name}"
                return pool
            pool.counter_sets[set_name] = counters
    for slc in pool.all_device_slices:
        for device in slc.devices:
            for set_name, counters in device.consumes_counters:
                if set_name not in pool.counter_sets:
                    pool.invalid_reason = f"counter set {set_name} not found"
                    return pool
                for counter in counters:
                    if counter not in pool.counter_sets[set_name]:
                        pool.invalid_reason = (
                            f"counter {counter} not found in counter set {set_name}"
                        )
                        return pool
    return pool


class SliceIndex:
    """One cluster's slices by the node they name, so gathering a node's pools reads that
    node's slices (and slices without a node name, and their pools' other slices) instead of
    every slice of the cluster. ``pools(node)`` equals ``gather_pools(slices, node)`` and is
    kept per node name: use one index per view of the cluster (slices and nodes unchanged)."""

    def __init__(self, slices: Sequence[ResourceSlice]) -> None:
        self.slices = list(slices)
        self._by_pool: dict[tuple[str, str], list[ResourceSlice]] = {}
        self._by_node: dict[str, set[tuple[str, str]]] = {}
        self._anywhere: set[tuple[str, str]] = set()  # pools with a slice without a node name
        for slc in self.slices:
            key = (slc.driver, slc.pool)
            self._by_pool.setdefault(key, []).append(slc)
            if slc.node_name:
                self._by_node.setdefault(slc.node_name, set()).add(key)
            else:
                self._anywhere.add(key)
        self._pools: dict[str, list[Pool]] = {}
        # Results callers derive from this view alone, kept with it (explain's device list).
        self.derived: dict[Hashable, Any] = {}

    def relevant(self, node_name: str) -> list[ResourceSlice]:
        """Every slice of every pool that has a slice the node might see."""
        keys = self._by_node.get(node_name, set()) | self._anywhere
        return [slc for key in sorted(keys) for slc in self._by_pool[key]]

    def pools(self, node: Node) -> list[Pool]:
        found = self._pools.get(node.name)
        if found is None:
            found = self._pools[node.name] = gather_pools(self.relevant(node.name), node)
        return found
