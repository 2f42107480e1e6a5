"""What existing allocations hold, as the scheduler accounts for it.

A result with admin access holds nothing. A result with a share ID is one share of a device that
allows multiple allocations: it adds its consumed capacity to the device's running total, and
marks the device as in use by shares (which matters for shared counters). Any other result makes
the device exclusively allocated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

from flexgpu.driver.allocation.capacity import add_amounts
from flexgpu.driver.allocation.model import ResourceClaim

DeviceId = tuple[str, str, str]  # driver, pool, device


@dataclass
class AllocatedState:
    exclusive: set[DeviceId] = field(default_factory=set)
    shared: set[DeviceId] = field(default_factory=set)
    consumed: dict[DeviceId, dict[str, Fraction]] = field(default_factory=dict)
    # Which claims hold each device (exclusively or by a share), for explanations.
    holders: dict[DeviceId, list[str]] = field(default_factory=dict)

    def is_allocated(self, device: DeviceId) -> bool:
        """Allocated in any way: such a device's counters are already spent."""
        return device in self.exclusive or device in self.shared or device in self.consumed


def allocated_state(claims: Iterable[ResourceClaim], skip: Iterable[str] = ()) -> AllocatedState:
    """State from the allocations of ``claims``, leaving out claims whose key is in ``skip``."""
    skipped = set(skip)
    state = AllocatedState()
    for claim in claims:
        if claim.allocation is None or claim.key in skipped:
            continue
        for result in claim.allocation:
            if result.admin_access:
                continue
            device = (result.driver, result.pool, result.device)
            state.holders.setdefault(device, []).append(claim.key)
            if result.share_id is not None:
                state.shared.add(device)
                if result.consumed_capacity is not None:
                    amounts = {k: q.value for k, q in result.consumed_capacity.items()}
                    add_amounts(state.consumed.setdefault(device, {}), amounts)
            else:
                state.exclusive.add(device)
    return state
