"""Consumable capacity: what one allocation takes from a device, and whether it still fits.

Every capacity of the device is charged on each allocation, requested or not: a capacity the
request does not name costs the policy's default, or else the whole value. A requested amount is
rounded up to what the policy allows (the range's minimum, the next step above the minimum, or the
next valid value); an amount the policy still does not allow makes the device unusable for the
request, as does a request naming a capacity the device does not have. Arithmetic is exact
(``Fraction``); it agrees with the scheduler for whole numbers and milli-unit values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction

from flexgpu.driver.allocation.model import DeviceCapacity, RequestPolicy

Amounts = Mapping[str, Fraction]


def consumed_amount(requested: Fraction | None, capacity: DeviceCapacity) -> Fraction:
    policy = capacity.policy
    if requested is None:
        if policy is not None and policy.default is not None:
            return policy.default
        return capacity.value
    if policy is None:
        return requested
    if policy.has_range and policy.range_min is not None:
        low = policy.range_min
        if requested < low:
            return low
        if policy.range_step is None:
            return requested
        steps = math.ceil((requested - low) / policy.range_step)
        return low + steps * policy.range_step
    if policy.valid_values is not None:
        for value in policy.valid_values:
            if requested <= value:
                return value
    return requested


def violates_policy(amount: Fraction, policy: RequestPolicy | None) -> bool:
    if policy is None:
        return False
    if policy.default is not None and amount == policy.default:
        return False
    if policy.has_range:
        if policy.range_max is not None and amount > policy.range_max:
            return True
        if policy.range_step is not None and policy.range_min is not None:
            return (amount - policy.range_min) % policy.range_step != 0
        return False
    if policy.valid_values:
        return amount not in policy.valid_values
    return False


def consumption(
    requests: Amounts | None, capacities: Mapping[str, DeviceCapacity]
) -> dict[str, Fraction]:
    """What one allocation of the device charges against each of its capacities."""
    return {
        name: consumed_amount(None if requests is None else requests.get(name), cap)
        for name, cap in capacities.items()
    }


def missing_capacities(
    requests: Amounts | None, capacities: Mapping[str, DeviceCapacity]
) -> list[str]:
    return sorted(set(requests or {}) - set(capacities))


def fits(
    requests: Amounts | None,
    capacities: Mapping[str, DeviceCapacity],
    *already: Amounts,
) -> bool:
    """True when the request is allowed by every policy and fits beside ``already`` consumed."""
    if missing_capacities(requests, capacities):
        return False
    for name, amount in consumption(requests, capacities).items():
        cap = capacities[name]
        if violates_policy(amount, cap.policy):
            return False
        total = amount
        for amounts in already:
            # Most devices hold nothing yet: skip Fraction arithmetic (slow) for them.
            extra = amounts.get(name)
            if extra is not None:
                total += extra
        if total > cap.value:
            return False
    return True


def add_amounts(target: dict[str, Fraction], amounts: Amounts, sign: int = 1) -> None:
    for name, value in amounts.items():
        target[name] = target.get(name, Fraction(0)) + sign * value
