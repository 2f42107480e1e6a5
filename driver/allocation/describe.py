"""Words for devices and amounts, as a workload author would write them."""

from __future__ import annotations

from collections.abc import Iterable
from fractions import Fraction

from flexgpu.driver.allocation.model import Device

# Attributes that name what a device is, most specific first.
_NAME_ATTRIBUTES = ("productName", "model", "profile", "type")
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_quantity(value: Fraction) -> str:
    """``25769803776`` -> ``24Gi``; falls back to a plain (or milli) number."""
    if value.denominator == 1:
        n = value.numerator
        for suffix, size in _BINARY:
            if n and n % size == 0:
                return f"{n // size}{suffix}"
        return str(n)
    milli = value * 1000
    if milli.denominator == 1:
        return f"{milli.numerator}m"
    return f"{float(value):g}"


def device_kind(device: Device) -> str:
    """A short description: what it is and how much memory, e.g. ``L4 with 24Gi``."""
    name = ""
    for attribute in _NAME_ATTRIBUTES:
        value = device.attributes.get(attribute)
        if value is not None and value.kind == "string":
            name = str(value.value)
            break
    memory = device.capacity.get("memory")
    if memory is not None:
        size = format_quantity(memory.value)
        return f"{name} with {size}" if name else f"device with {size}"
    return name or "device"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def summarize_kinds(devices: Iterable[Device], limit: int = 3) -> str:
    """``2 L4 with 24Gi, 1 T4 with 16Gi``: the commonest kinds first."""
    counts: dict[str, int] = {}
    for device in devices:
        kind = device_kind(device)
        counts[kind] = counts.get(kind, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{n} {kind}" for kind, n in ordered[:limit])
    if len(ordered) > limit:
        text += f" and {sum(n for _, n in ordered[limit:])} more"
    return text
