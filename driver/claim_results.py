"""One entry of a ResourceClaim's ``status.allocation.devices.results``, parsed once for both
the kubelet plugin (prepare) and the allocator (explain, capacity).

Kept apart from ``driver.allocation`` on purpose: that package loads the CEL library, and the
kubelet plugin, which only needs this model, must not pay for it at start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flexgpu.driver.quantity import Quantity, QuantityError, parse_quantity


class ClaimResultError(ValueError):
    """An allocation result does not have the shape the API gives it; names the field."""


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result. ``consumed_capacity`` is None when the result has none (a device
    allocated whole); each value keeps its text as written, for status and checkpoint, and its
    exact value, for capacity sums."""

    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool = False
    share_id: str | None = None
    consumed_capacity: Mapping[str, Quantity] | None = None
    # The device's binding conditions (KEP-5007) as the scheduler copied them from the slice.
    binding_conditions: tuple[str, ...] = ()

    @property
    def base_request(self) -> str:
        """``gpu/h100`` (a firstAvailable subrequest) -> ``gpu``: what the kubelet matches."""
        return self.request.split("/", 1)[0]

    def consumed_texts(self) -> dict[str, str]:
        """The consumed capacity as the claim writes it (``{"memory": "8Gi"}``); empty if none."""
        return {name: q.text for name, q in (self.consumed_capacity or {}).items()}


def parse_consumed_capacity(
    data: Any, where: str = "consumedCapacity"
) -> Mapping[str, Quantity] | None:
    """``consumedCapacity`` of one result: None when absent, else each value parsed exactly.
    A value that is not a quantity raises ``ClaimResultError`` naming ``where.<name>``."""
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ClaimResultError(f"{where}: expected an object, got {type(data).__name__}")
    parsed = {}
    for name, text in data.items():
        try:
            # The API serialises quantities as strings; a number is accepted as its text.
            parsed[str(name)] = parse_quantity(text if isinstance(text, str) else str(text))
        except QuantityError as err:
            raise ClaimResultError(f"{where}.{name}: {err}") from None
    return parsed


def parse_allocated_device(data: Any, where: str = "result") -> AllocatedDevice:
    """One entry of ``status.allocation.devices.results`` (JSON as the API returns it)."""
    if not isinstance(data, Mapping):
        raise ClaimResultError(f"{where}: expected an object, got {type(data).__name__}")
    return AllocatedDevice(
        request=str(data.get("request", "")),
        driver=str(data.get("driver", "")),
        pool=str(data.get("pool", "")),
        device=str(data.get("device", "")),
        admin_access=bool(data.get("adminAccess") or False),
        # The API never writes an empty shareID; treating one as absent keeps it unshared.
        share_id=str(data["shareID"]) if data.get("shareID") else None,
        consumed_capacity=parse_consumed_capacity(
            data.get("consumedCapacity"), f"{where}.consumedCapacity"
        ),
        binding_conditions=_strings(data.get("bindingConditions"), f"{where}.bindingConditions"),
    )


def _strings(data: Any, where: str) -> tuple[str, ...]:
    if data is None:
        return ()
    if not isinstance(data, list) or not all(isinstance(s, str) for s in data):
        raise ClaimResultError(f"{where}: expected a list of strings, got {data!r}")
    return tuple(data)
