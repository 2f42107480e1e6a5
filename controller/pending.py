"""Which claims the diagnostics look at: unallocated claims on flexgpu's DeviceClasses that a
pod, still without a node, has been waiting for longer than the grace period.

The grace period matters: every new pod is Pending for the moment the scheduler takes, and
explaining those would only add noise (and CPU) to normal scheduling.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.records import CachedClaim, PodRecord
from flexgpu.driver.allocation import DeviceClass
from flexgpu.driver.names import (
    DRIVER_NAME,
    GPU_DEVICE_CLASS,
    MIG_DEVICE_CLASS,
    SHARED_GPU_DEVICE_CLASS,
)

SHIPPED_CLASSES: Final = frozenset({GPU_DEVICE_CLASS, MIG_DEVICE_CLASS, SHARED_GPU_DEVICE_CLASS})
# How a selector names our driver: `device.driver == "gpu.flexgpu.dev"` or an attribute domain
# `device.attributes["gpu.flexgpu.dev"]`; quoted, so "x.gpu.flexgpu.dev" does not count.
_DRIVER_LITERALS: Final = (f'"{DRIVER_NAME}"', f"'{DRIVER_NAME}'")


@dataclass(frozen=True)
class PendingClaim:
    pod: PodRecord
    claim: CachedClaim
    waiting_s: float


def our_classes(classes: Mapping[str, DeviceClass]) -> frozenset[str]:
    """The shipped classes plus any class an admin wrote whose selectors mention our driver."""
    extra = {
        name
        for name, device_class in classes.items()
        if any(lit in sel for sel in device_class.selectors for lit in _DRIVER_LITERALS)
    }
    return SHIPPED_CLASSES | extra


def pending_claims(snapshot: Snapshot, now: datetime, delay_s: float) -> Iterator[PendingClaim]:
    """Unallocated claims on our classes whose pod has waited at least ``delay_s``, oldest
    pod first."""
    ours = our_classes(snapshot.classes)
    pods = sorted(
        (p for p in snapshot.pods.values() if p.created is not None),
        key=lambda p: (p.created, p.key),
    )
    for pod in pods:
        if pod.node_name or pod.phase != "Pending" or pod.deleting or pod.created is None:
            continue
        waiting = (now - pod.created).total_seconds()
        if waiting < delay_s:
            continue
        for key in pod.claim_keys():
            claim = snapshot.claims.get(key)
            if claim is None or claim.allocated or not claim.device_classes & ours:
                continue
            yield PendingClaim(pod, claim, waiting)
