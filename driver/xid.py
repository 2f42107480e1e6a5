"""What an Xid error says about the GPU: nothing (the application faulted), something worth
knowing (the GPU keeps working), or that nothing new should run on it.

Classes follow NVIDIA's Xid catalog. An Xid not listed here is treated as a hardware fault, as
NVIDIA's device plugin does: a GPU that reports something unknown is not trusted with new work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# 13 graphics engine exception, 31 MMU fault, 43 channel stopped, 45 preemptive cleanup,
# 68 video processor exception, 109 context switch timeout: all caused by the workload.
APPLICATION_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


class XidImpact(StrEnum):
    """What a fault means for new work on the GPU (the device taint's effect)."""

    INFORMATIONAL = "None"  # the GPU keeps working; recorded so admins see it
    FATAL = "NoSchedule"  # nothing new may land on the GPU


class FaultClass(StrEnum):
    """The part of the GPU a fault concerns: the name part of its device taint key."""

    GPU_LOST = "gpu-lost"
    MEMORY = "memory-error"
    HARDWARE = "hardware-error"
    NVML = "nvml-unavailable"


@dataclass(frozen=True)
class XidKind:
    fault: FaultClass
    impact: XidImpact
    what: str


_KNOWN: dict[int, XidKind] = {
    # Memory: double-bit and uncontained errors need a GPU reset; a recorded row remap (63),
    # a contained error (94, only the process that hit it died) and a high single-bit rate
    # (92) leave the GPU usable until its next reset.
    48: XidKind(FaultClass.MEMORY, XidImpact.FATAL, "double-bit ECC error"),
    63: XidKind(FaultClass.MEMORY, XidImpact.INFORMATIONAL, "ECC row remap recorded"),
    64: XidKind(FaultClass.MEMORY, XidImpact.FATAL, "ECC row remap failed"),
    92: XidKind(FaultClass.MEMORY, XidImpact.INFORMATIONAL, "high single-bit ECC error rate"),
    94: XidKind(FaultClass.MEMORY, XidImpact.INFORMATIONAL, "contained ECC error"),
    95: XidKind(FaultClass.MEMORY, XidImpact.FATAL, "uncontained ECC error"),
    79: XidKind(FaultClass.GPU_LOST, XidImpact.FATAL, "GPU has fallen off the bus"),
    74: XidKind(FaultClass.HARDWARE, XidImpact.FATAL, "NVLink error"),
    119: XidKind(FaultClass.HARDWARE, XidImpact.FATAL, "GSP RPC timeout"),
    120: XidKind(FaultClass.HARDWARE, XidImpact.FATAL, "GSP error"),
}


def classify_xid(xid: int, ignored: frozenset[int] = frozenset()) -> XidKind | None:
    """None for an Xid that says nothing about the GPU (an application fault, or one the
    admin's policy lists in ``spec.health.ignoredXids``)."""
    if xid in APPLICATION_XIDS or xid in ignored:
        return None
    return _KNOWN.get(xid, XidKind(FaultClass.HARDWARE, XidImpact.FATAL, "hardware fault"))


def xid_marks_unhealthy(xid: int) -> bool:
    """Whether the Xid keeps new work off the GPU (the backends' own health flag)."""
    kind = classify_xid(xid)
    return kind is not None and kind.impact == XidImpact.FATAL
