"""``matchAttribute`` and ``distinctAttribute`` claim constraints, checked device by device.

Both are monotonic, which is what lets the search reject a device as soon as it breaks one: the
first device a ``matchAttribute`` constraint sees fixes the value the others must have, and a
``distinctAttribute`` constraint refuses any value already taken. A device without the attribute
never satisfies either. List-valued attributes cannot be compared and so only ever pass as the
first device of a set, as in the scheduler.
"""

from __future__ import annotations

from flexgpu.driver.allocation.model import AttributeValue, Constraint, Device


def lookup_attribute(device: Device, driver: str, name: str) -> AttributeValue | None:
    """A fully qualified attribute; the driver's own domain may be left off in the slice."""
    if name in device.attributes:
        return device.attributes[name]
    domain, sep, ident = name.partition("/")
    if not sep or domain != driver:
        return None
    return device.attributes.get(ident)


def _same(a: AttributeValue, b: AttributeValue) -> bool:
    return not a.is_list and a.kind == b.kind and a.value == b.value


class ConstraintState:
    """One constraint's running state during a search; ``add``/``remove`` come in pairs."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.requests = frozenset(constraint.requests)
        self.values: list[AttributeValue] = []

    def applies(self, request: str, subrequest: str | None) -> bool:
        if not self.requests:
            return True
        if request in self.requests:
            return True
        return subrequest is not None and f"{request}/{subrequest}" in self.requests

    def add(self, request: str, subrequest: str | None, device: Device, driver: str) -> bool:
        if not self.applies(request, subrequest):
            return True
        value = lookup_attribute(device, driver, self.constraint.attribute)
        if value is None:
            return False
        if self.constraint.kind == "matchAttribute":
            if self.values and (value.is_list or not _same(value, self.values[0])):
                return False
        elif self.values and (value.is_list or any(_same(value, v) for v in self.values)):
            return False
        self.values.append(value)
        return True

    def remove(self, request: str, subrequest: str | None) -> None:
        if self.applies(request, subrequest):
            self.values.pop()
