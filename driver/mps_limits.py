"""Which pinned-memory limit each device of an MPS config gets, keyed as NVIDIA keys it.

``sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit`` is a map whose keys NVIDIA's DRA driver
reads as the UUID of one of the devices the config applies to, or as an index into those
devices ordered by UUID (``"0"`` is the device with the smallest UUID). Reading the key as the
node's GPU index instead would put a user's limit on the wrong device, or nowhere. This driver
also takes a device's published name (``gpu-3``). A key that matches none of the devices is an
error, not a silently dropped limit: prepare refuses it here with every device listed, and
admission refuses indices beyond the number of devices the claim asks for
(``index_keys_beyond``), which is all it can know before allocation. A MIG partition that
prepare creates has no UUID until it exists: ``unmatched_keys`` checks the keys against such
devices by index and name before anything is created, and the limits are worked out once the
UUIDs are known. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from flexgpu.driver.opaque_config import ConfigProblem, MpsConfig, show_value
from flexgpu.driver.quantity import Quantity

__all__ = [
    "ConfiguredDevice",
    "PinnedLimitError",
    "index_keys_beyond",
    "pinned_memory_limits",
    "unmatched_keys",
]

_FIELD: Final = ("sharing", "mpsConfig", "defaultPerDevicePinnedMemoryLimit")


@dataclass(frozen=True)
class ConfiguredDevice:
    """One allocated device a config applies to: its published name and its UUID (``None``
    for a MIG partition not created yet)."""

    name: str
    uuid: str | None


class PinnedLimitError(ValueError):
    """Keys of ``defaultPerDevicePinnedMemoryLimit`` match no device; ``problems`` says which."""

    def __init__(self, problems: Sequence[ConfigProblem]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(p.render() for p in self.problems))


def _index(key: str) -> int | None:
    # NVIDIA parses the key with strconv.Atoi: plain decimal digits (a sign never matches).
    return int(key) if key.isascii() and key.isdigit() else None


def pinned_memory_limits(
    mps: MpsConfig, devices: Sequence[ConfiguredDevice]
) -> dict[str, Quantity | None]:
    """The limit per device name: ``defaultPinnedDeviceMemoryLimit`` (``None``: no limit),
    overridden by the per-device entries. Every UUID must be known. Raises
    ``PinnedLimitError`` listing every key that names no device of ``devices``."""
    if any(d.uuid is None for d in devices):
        raise ValueError("pinned_memory_limits needs every device's UUID")
    problems = unmatched_keys(mps, devices)
    if problems:
        raise PinnedLimitError(problems)
    ordered = sorted(devices, key=lambda d: d.uuid or "")
    limits: dict[str, Quantity | None] = {
        d.name: mps.defaultPinnedDeviceMemoryLimit for d in ordered
    }
    for key, value in sorted((mps.defaultPerDevicePinnedMemoryLimit or {}).items()):
        match = _match(key, ordered)
        if match is not None:
            limits[match.name] = value
    return limits


def unmatched_keys(mps: MpsConfig, devices: Sequence[ConfiguredDevice]) -> list[ConfigProblem]:
    """Every key of ``defaultPerDevicePinnedMemoryLimit`` that names none of ``devices``. An
    index matches when it is below their number, whether their UUIDs are known or not."""
    ordered = sorted(devices, key=lambda d: (d.uuid is None, d.uuid or "", d.name))
    return [
        _unmatched_problem(key, ordered)
        for key in sorted(mps.defaultPerDevicePinnedMemoryLimit or {})
        if _match(key, ordered) is None
    ]


def _match(key: str, ordered: Sequence[ConfiguredDevice]) -> ConfiguredDevice | None:
    match = next((d for d in ordered if key in (d.uuid, d.name)), None)
    index = _index(key)
    if match is None and index is not None and index < len(ordered):
        match = ordered[index]
    return match


def _unmatched_problem(key: str, ordered: Sequence[ConfiguredDevice]) -> ConfigProblem:
    if not ordered:
        allowed = "no key: the config applies to no device"
    elif any(d.uuid is None for d in ordered):
        unknown = "UUID given when it is created"
        listed = ", ".join(f"{d.name} ({d.uuid or unknown})" for d in ordered)
        allowed = (
            f"an index from 0 to {len(ordered) - 1} (the devices in UUID order), or the name "
            f"or UUID of a device the config applies to ({listed})"
        )
    else:
        listed = ", ".join(f"{i} = {d.name} ({d.uuid})" for i, d in enumerate(ordered))
        allowed = (
            f"an index from 0 to {len(ordered) - 1}, or the name or UUID of a device the "
            f"config applies to (by UUID order: {listed})"
        )
    detail = f"key {show_value(key)} matches no device of the claim; allowed: {allowed}"
    return ConfigProblem(_FIELD, detail)


def index_keys_beyond(mps: MpsConfig, device_count: int) -> list[ConfigProblem]:
    """Admission's check: index keys not below ``device_count``, the number of devices the
    config applies to. Names and UUIDs are left to prepare (before allocation no device is
    known)."""
    problems = []
    for key in sorted(mps.defaultPerDevicePinnedMemoryLimit or {}):
        index = _index(key)
        if index is not None and index >= device_count:
            allowed = (
                f"an index below {device_count} (the config applies to {device_count} "
                f"device{'s' if device_count != 1 else ''}, indexed by UUID order from 0)"
            )
            detail = f"key {show_value(key)} matches no device of the claim; allowed: {allowed}"
            problems.append(ConfigProblem(_FIELD, detail))
    return problems
