"""The search over every node a pod may use, as the scheduler has it: an error on any node
stops scheduling on all of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flexgpu.driver.allocation.allocator import Outcome, Verdict, allocate
from flexgpu.driver.allocation.model import DeviceClass, Node, ResourceClaim, ResourceSlice
from flexgpu.driver.allocation.pools import SliceIndex
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.allocation.state import AllocatedState


@dataclass(frozen=True)
class ClusterVerdict:
    """Across the nodes a pod may use: an error on any node stops the scheduler for all."""

    outcome: Outcome
    per_node: tuple[Verdict, ...] = field(default_factory=tuple)

    @property
    def allocatable_nodes(self) -> list[str]:
        return [v.node for v in self.per_node if v.allocatable]


def allocate_anywhere(
    claims: Sequence[ResourceClaim],
    nodes: Sequence[Node],
    slices: Sequence[ResourceSlice],
    classes: Mapping[str, DeviceClass],
    state: AllocatedState,
    *,
    selectors: SelectorCache | None = None,
    index: SliceIndex | None = None,
) -> ClusterVerdict:
    selectors = selectors or SelectorCache()
    verdicts = tuple(
        allocate(claims, n, slices, classes, state, selectors=selectors, index=index) for n in nodes
    )
    if any(v.outcome == "error" for v in verdicts):
        return ClusterVerdict("error", verdicts)
    if any(v.allocatable for v in verdicts):
        return ClusterVerdict("allocatable", verdicts)
    return ClusterVerdict("unallocatable", verdicts)
