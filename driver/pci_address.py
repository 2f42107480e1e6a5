"""PCI address normalisation: NVML prints an 8-digit domain, sysfs and Kubernetes use 4."""

from __future__ import annotations

import re

_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):"
    r"(?P<device>[0-9a-fA-F]{2})\.(?P<function>[0-7])$"
)


def normalize_pci_bus_id(bus_id: str) -> str:
    """``00000000:3B:00.0`` -> ``0000:3b:00.0`` (the sysfs form). Raises ValueError if malformed."""
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        raise ValueError(f"malformed PCI bus id {bus_id!r}; expected DDDD:BB:DD.F")
    domain = int(match["domain"] or "0", 16)
    return f"{domain:04x}:{match['bus'].lower()}:{match['device'].lower()}.{match['function']}"
