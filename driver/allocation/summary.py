"""Free and total devices per kind, for ``flexgpu capacity``.

Devices are grouped by their ``type`` attribute (gpu, mig, ...), product and MIG profile. A
device is free when no claim holds it and, for a partition, its shared counters are not spent
by allocated partitions that overlap it. Devices that allow multiple allocations also report the
consumable capacity left beside their current shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from flexgpu.driver.allocation.capacity import add_amounts
from flexgpu.driver.allocation.model import Device, ResourceClaim, ResourceSlice
from flexgpu.driver.allocation.state import AllocatedState, allocated_state
from flexgpu.driver.names import DRIVER_NAME


@dataclass
class CapacityRow:
    type: str
    product: str
    profile: str
    total: int = 0
    free: int = 0
    # capacity name -> (remaining, total) over the devices that allow multiple allocations
    shareable: dict[str, tuple[Fraction, Fraction]] = field(default_factory=dict)


def _string(device: Device, name: str) -> str:
    value = device.attributes.get(name)
    return str(value.value) if value is not None and value.kind == "string" else ""


def current_slices(slices: Sequence[ResourceSlice]) -> list[ResourceSlice]:
    """The slices of complete pools at their newest generation."""
    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        key = (s.driver, s.pool)
        newest[key] = max(newest.get(key, s.generation), s.generation)
    current = [s for s in slices if s.generation == newest[(s.driver, s.pool)]]
    counts: dict[tuple[str, str], int] = {}
    for s in current:
        counts[(s.driver, s.pool)] = counts.get((s.driver, s.pool), 0) + 1
    return [s for s in current if counts[(s.driver, s.pool)] == s.resource_slice_count]


def _spent_counters(
    pool_slices: Sequence[ResourceSlice], state: AllocatedState
) -> dict[str, dict[str, Fraction]]:
    """Counters left per counter set once allocated devices took theirs."""
    left: dict[str, dict[str, Fraction]] = {}
    for s in pool_slices:
        for name, counters in s.shared_counters:
            left[name] = dict(counters)
    for s in pool_slices:
        for device in s.devices:
            if state.is_allocated((s.driver, s.pool, device.name)):
                for name, counters in device.consumes_counters:
                    add_amounts(left.setdefault(name, {}), counters, -1)
    return left


def capacity_summary(
    slices: Sequence[ResourceSlice], claims: Sequence[ResourceClaim], driver: str = DRIVER_NAME
) -> list[CapacityRow]:
    state = allocated_state(claims)
    ours = [s for s in current_slices(slices) if s.driver == driver]
    rows: dict[tuple[str, str, str], CapacityRow] = {}
    for pool in sorted({s.pool for s in ours}):
        pool_slices = [s for s in ours if s.pool == pool]
        left = _spent_counters(pool_slices, state)
        for s in pool_slices:
            for device in s.devices:
                kind = (
                    _string(device, "type") or "device",
                    _string(device, "productName"),
                    _string(device, "profile"),
                )
                row = rows.setdefault(kind, CapacityRow(*kind))
                row.total += 1
                did = (s.driver, s.pool, device.name)
                counters_ok = all(
                    left.get(name, {}).get(c, Fraction(0)) >= amount
                    for name, counters in device.consumes_counters
                    for c, amount in counters.items()
                )
                if not state.is_allocated(did) and counters_ok:
                    row.free += 1
                if device.allow_multiple_allocations:
                    used = state.consumed.get(did, {})
                    for name, capacity in device.capacity.items():
                        policy = capacity.policy
                        if policy is not None and policy.valid_values == (Fraction(0),):
                            continue  # informational (multiprocessors): never consumed
                        remaining, total = row.shareable.get(name, (Fraction(0), Fraction(0)))
                        row.shareable[name] = (
                            remaining
                            + max(capacity.value - used.get(name, Fraction(0)), Fraction(0)),
                            total + capacity.value,
                        )
    return [rows[k] for k in sorted(rows)]
