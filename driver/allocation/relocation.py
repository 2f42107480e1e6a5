"""Whether the pods GPU clearing would evict have somewhere else to run now.

Evicting a holder's pod is worth its restart only if its replacement runs at once: one that
waits has stopped serving, and the GPU it freed lets one claim in while another now waits.
So before the holders of a GPU are evicted (``driver.allocation.consolidation``), each
moving pod's claims are placed, as fresh unallocated claims with the same requests and
constraints (a ResourceClaimTemplate makes the replacement's claims the same), with the
explanation and the allocator that judge pending claims:

- the moving pods' own allocations are freed (their claims are deleted with them);
- the devices flexgpu keeps new claims off (``held_off``: the GPU being cleared, every other
  GPU being cleared, the nodes being steered) are left out of the slices, as if unpublished.
  Counting them as allocated instead would charge the shared counters of every placement of
  a GPU partitioned on demand at once, overdrawing its counter set, and an overdrawn set
  fails every device of its pool;
- the pods are placed one after another on a copy of the allocated state, so two holders do
  not both count on the last free device. A pod's claims go on one node together, the first
  node (in the order given) on which all of them can be allocated.

The scheduler may pick another node than the first that fits; what is decided here is that
one exists, not where the pod will run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flexgpu.driver.allocation.allocator import DeviceChoice, allocate
from flexgpu.driver.allocation.capacity import add_amounts
from flexgpu.driver.allocation.explain import explain_claim
from flexgpu.driver.allocation.model import DeviceClass, Node, ResourceClaim, ResourceSlice
from flexgpu.driver.allocation.pools import SliceIndex
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.allocation.state import AllocatedState, DeviceId, allocated_state


@dataclass(frozen=True)
class MovingPod:
    """A pod to be evicted, with what its replacement will ask for."""

    pod: str  # namespace/name, for words
    claims: tuple[ResourceClaim, ...]  # the claims generated for it, as allocated now
    usable_nodes: tuple[str, ...] | None  # nodes its pod may use (None: all)


@dataclass(frozen=True)
class Stranded:
    """A moving pod whose claims fit nowhere else now."""

    pod: str
    claim: str  # the first of its claims with nowhere to go (namespace/name)
    why: str  # in words for an Event


def add_choices(state: AllocatedState, choices: Iterable[DeviceChoice]) -> None:
    """Adds one allocation to ``state``, as ``allocated_state`` accounts an allocation result."""
    for choice in choices:
        if choice.admin_access:
            continue
        device = (choice.driver, choice.pool, choice.device)
        if choice.shared:
            state.shared.add(device)
            if choice.consumed_capacity is not None:
                add_amounts(state.consumed.setdefault(device, {}), dict(choice.consumed_capacity))
        else:
            state.exclusive.add(device)


def stranded(
    moving: Sequence[MovingPod],
    *,
    slices: Sequence[ResourceSlice],
    classes: Mapping[str, DeviceClass],
    claims: Sequence[ResourceClaim],
    nodes: Sequence[Node],
    held_off: Iterable[DeviceId],
    selectors: SelectorCache | None = None,
) -> Stranded | None:
    """The first of ``moving`` (in the order given) whose claims cannot all be allocated
    elsewhere now, counting those placed before it; None when every one fits."""
    slices = without(slices, held_off)
    index = SliceIndex(slices)
    selectors = selectors or SelectorCache()
    # A state of its own: placements are added to it as the pods are placed.
    trial = allocated_state(claims, skip={c.key for m in moving for c in m.claims})
    by_name = {n.name: n for n in nodes}
    for pod in moving:
        fresh = [dataclasses.replace(c, allocation=None) for c in pod.claims]
        if not fresh:
            continue
        wanted: list[str] | None = list(pod.usable_nodes) if pod.usable_nodes is not None else None
        for claim in fresh:
            explanation = explain_claim(
                claim,
                slices,
                classes,
                claims,
                nodes,
                usable_nodes=wanted,
                selectors=selectors,
                state=trial,
                index=index,
            )
            fits = [n for n in explanation.allocatable_nodes if wanted is None or n in wanted]
            if not fits:
                return Stranded(pod.pod, claim.key, _why(claim.key, explanation.outcome))
            wanted = fits
        placed = None
        for name in wanted or ():
            verdict = allocate(
                fresh, by_name[name], slices, classes, trial, selectors=selectors, index=index
            )
            if verdict.allocatable:
                placed = verdict
                break
        if placed is None:
            return Stranded(
                pod.pod, fresh[0].key, f"the claims of pod {pod.pod} fit on no one node together"
            )
        for choices in placed.devices:
            add_choices(trial, choices)
    return None


def without(slices: Sequence[ResourceSlice], devices: Iterable[DeviceId]) -> list[ResourceSlice]:
    """``slices`` less ``devices``; untouched slices are the same objects."""
    off = set(devices)
    if not off:
        return list(slices)
    return [
        slc
        if not any((slc.driver, slc.pool, d.name) in off for d in slc.devices)
        else dataclasses.replace(
            slc, devices=tuple(d for d in slc.devices if (slc.driver, slc.pool, d.name) not in off)
        )
        for slc in slices
    ]


def _why(claim: str, outcome: str) -> str:
    if outcome == "error":
        return f"the scheduler could not allocate claim {claim} anywhere (an error)"
    return (
        f"claim {claim} fits on no device outside the GPUs flexgpu keeps new claims off, "
        "counting the other holders being moved"
    )
