"""A node's GPU faults as device taints: what each GPU has reported, how bad it is, and when
it may be trusted again.

Each fault is kept per scope (a GPU, or one MIG device of it when NVML names the GPU
instance an Xid came from) under its class (``FaultClass``), with the worst impact seen and
the time it was last seen; it is cleared once nothing of its class has been seen for the
healthy period. A lost GPU and an unreachable NVML are seen again on every check while they
last, so their period starts when they end. Pure and clock-free: callers pass the time.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from typing import Any

from flexgpu.driver.gpu_model import HealthEvent, HealthEventKind
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.xid import FaultClass, XidImpact, classify_xid

DEFAULT_HEALTHY_PERIOD_S = 300.0

# Where a fault applies: (GPU index, None) for the whole GPU and everything carved from it,
# (GPU index, device name) for one MIG device.
Scope = tuple[int, str | None]


def taint_key(fault: FaultClass) -> str:
    return f"{DRIVER_NAME}/{fault.value}"


@dataclass(frozen=True)
class Fault:
    """One class of fault on one GPU, as published in a device taint."""

    fault: FaultClass
    impact: XidImpact
    value: str  # the taint's value: a label value such as "xid-48"
    message: str
    last_seen: float

    @property
    def fatal(self) -> bool:
        return self.impact == XidImpact.FATAL

    def taint(self) -> dict[str, Any]:
        return {"key": taint_key(self.fault), "value": self.value, "effect": self.impact.value}


def fault_for_event(
    event: HealthEvent, now: float, ignored_xids: frozenset[int] = frozenset()
) -> Fault | None:
    """The fault a backend event reports, or None when it says nothing about the GPU."""
    if event.kind == HealthEventKind.GPU_LOST:
        return Fault(FaultClass.GPU_LOST, XidImpact.FATAL, "lost", "GPU lost (not reachable)", now)
    if event.xid is None:
        return None
    kind = classify_xid(event.xid, ignored_xids)
    if kind is None:
        return None
    return Fault(kind.fault, kind.impact, f"xid-{event.xid}", f"Xid {event.xid}: {kind.what}", now)


def nvml_unavailable(now: float, why: str) -> Fault:
    # Without NVML nothing about the GPU can be checked, so nothing new is placed on it.
    return Fault(FaultClass.NVML, XidImpact.FATAL, "unavailable", f"NVML unavailable: {why}", now)


class HealthLedger:
    """Faults per scope. Not thread-safe: its owner serialises access."""

    def __init__(self, healthy_period_s: float = DEFAULT_HEALTHY_PERIOD_S) -> None:
        if healthy_period_s < 0:
            raise ValueError(f"healthy period {healthy_period_s!r}: must be 0 seconds or more")
        self.healthy_period_s = healthy_period_s
        self._faults: dict[Scope, dict[FaultClass, Fault]] = {}

    def record(self, scope: Scope, fault: Fault) -> bool:
        """Adds or refreshes a fault; True when what is published changes (a new class, a
        worse impact or a new value), False when only its time moved."""
        faults = self._faults.setdefault(scope, {})
        old = faults.get(fault.fault)
        if old is None:
            faults[fault.fault] = fault
            return True
        # The worse impact stays for the whole episode: an informational Xid after a fatal
        # one must not make the GPU look usable.
        if old.fatal and not fault.fatal:
            faults[fault.fault] = replace(old, last_seen=max(old.last_seen, fault.last_seen))
            return False
        faults[fault.fault] = fault
        return (old.impact, old.value) != (fault.impact, fault.value)

    def still_seen(self, gpu_indices: Iterable[int], fault: FaultClass, now: float) -> None:
        """Moves the last-seen time of ``fault`` on these whole GPUs to now (still there)."""
        for index in gpu_indices:
            old = self._faults.get((index, None), {}).get(fault)
            if old is not None:
                self._faults[(index, None)][fault] = replace(old, last_seen=now)

    def expire(self, now: float) -> list[tuple[Scope, Fault]]:
        """Clears faults not seen for the healthy period; returns what was cleared."""
        cleared: list[tuple[Scope, Fault]] = []
        for scope, faults in list(self._faults.items()):
            for fault in list(faults.values()):
                if now - fault.last_seen >= self.healthy_period_s:
                    del faults[fault.fault]
                    cleared.append((scope, fault))
            if not faults:
                del self._faults[scope]
        return cleared

    def with_fault(self, fault: FaultClass) -> set[int]:
        """GPUs with this fault on the whole GPU."""
        return {i for (i, device), f in self._faults.items() if device is None and fault in f}

    def faults(self) -> dict[Scope, list[Fault]]:
        """Scope -> its faults, ordered by class name (stable taint order)."""
        return {
            scope: sorted(faults.values(), key=lambda f: f.fault.value)
            for scope, faults in self._faults.items()
            if faults
        }


def is_fatal(faults: Collection[Fault]) -> bool:
    return any(f.fatal for f in faults)


def health_message(faults: Collection[Fault]) -> str:
    return "; ".join(f.message for f in faults)


_FAULT_TEXT = {
    FaultClass.GPU_LOST: "GPU lost",
    FaultClass.MEMORY: "memory error",
    FaultClass.HARDWARE: "hardware fault",
    FaultClass.NVML: "NVML unavailable",
}


def describe_taint(key: str, value: str) -> str:
    """What one of our device taints means, for people (``flexgpu health``); a key this
    driver does not set is shown as it is."""
    for fault, text in _FAULT_TEXT.items():
        if key == taint_key(fault):
            xid = value.removeprefix("xid-")
            if value.startswith("xid-") and xid.isdigit():
                kind = classify_xid(int(xid))
                return f"{text}: Xid {xid}" + (f" ({kind.what})" if kind else "")
            return text
    return f"{key}={value}" if value else key
