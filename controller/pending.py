"""Which claims the diagnostics look at: unallocated claims on flexgpu's DeviceClasses that a
pod, still without a node, has been waiting for longer than the grace period, and the claim
the scheduler would make for such a pod's extended resources (``nvidia.com/gpu: 2``) that one
of those classes serves.

The grace period matters: every new pod is Pending for the moment the scheduler takes, and
explaining those would only add noise (and CPU) to normal scheduling.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.extended_resources import class_for
from flexgpu.controller.records import CachedClaim, PodRecord
from flexgpu.driver.allocation import DeviceClass
from flexgpu.driver.allocation.model import DeviceRequest, RequestSpec, ResourceClaim
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


def extended_resource_claim(
    pod: PodRecord, classes: Mapping[str, DeviceClass], ours: frozenset[str]
) -> CachedClaim | None:
    """The claim the scheduler would make for the pod's extended resources that our classes
    serve (one request per resource), or None when it asks for none of them or the
    scheduler already made it."""
    if pod.extended_claim_made or not pod.extended_resources:
        return None
    by_name = {c.extended_resource_name: n for n, c in classes.items() if c.extended_resource_name}
    requests = []
    for resource, count in sorted(pod.extended_resources.items()):
        device_class = class_for(resource, by_name)
        if device_class is None or device_class not in ours:
            continue
        spec = RequestSpec(name=resource, device_class=device_class, count=count)
        requests.append((resource, count, DeviceRequest(name=resource, exactly=spec)))
    if not requests:
        return None
    model = ResourceClaim(
        name=f"{pod.name} (extended resources)",
        namespace=pod.namespace,
        uid=f"{pod.uid}/extended-resources",
        requests=tuple(r for _, _, r in requests),
    )
    return CachedClaim(
        model=model,
        created=pod.created,
        device_classes=frozenset(r.exactly.device_class for _, _, r in requests if r.exactly),
        extended_resources=tuple((name, count) for name, count, _ in requests),
    )


def pending_claims(snapshot: Snapshot, now: datetime, delay_s: float) -> Iterator[PendingClaim]:
    """Unallocated claims on our classes whose pod has waited at least ``delay_s``, oldest
    pod first; a pod's extended resources that our classes serve count as one more claim."""
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
        extended = extended_resource_claim(pod, snapshot.classes, ours)
        if extended is not None:
            yield PendingClaim(pod, extended, waiting)
