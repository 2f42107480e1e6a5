"""Pods held by the scheduler for flexgpu's binding conditions (KEP-5007, Kubernetes 1.36+).

An on-demand MIG partition carries ``PartitionReady`` and a free shared GPU ``TenantReady``:
the scheduler allocates the claim, then holds the pod in PreBind (600 s by default) until the
node's kubelet plugin sets the condition True in the claim's ``status.devices``. When the
plugin is down, slow, or its write is refused, the pod waits with nothing but the scheduler's
generic ``BindingConditionsPending``. Each pass finds the claims allocated with one of
flexgpu's devices whose binding conditions are not all True yet (and no failure condition
is), with a pod still without a node, for longer than the grace period (counted from
``status.allocation.allocationTimestamp``, else from when the controller first saw the
allocation), and records a Warning Event with the reason ``GpuBindingConditionPending`` on
the pod and on the claim saying which condition of which device on which node it waits for,
since when, and what to check.

Not spamming, as the diagnostics: an Event when a pod/claim pair is first found waiting,
again when what it waits for changes, and otherwise only after ``reemit_s``. Tracking ends
when the conditions are met, a failure condition is set, the claim is deallocated, or the
pod is bound or gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from flexgpu.controller import metrics
from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.diagnostics import DEFAULT_REEMIT_S
from flexgpu.controller.events import EventSink, EventTarget
from flexgpu.controller.records import CachedClaim, DeviceBinding, PodRecord
from flexgpu.driver.durations import human_duration
from flexgpu.driver.names import PARTITION_READY_CONDITION, TENANT_READY_CONDITION

log = logging.getLogger(__name__)

REASON: Final = "GpuBindingConditionPending"
DEFAULT_GRACE_S: Final = 60.0
# Conditions the metric always exports (0 when nothing waits), so a rule can read them.
KNOWN_CONDITIONS: Final = (PARTITION_READY_CONDITION, TENANT_READY_CONDITION)
# Devices named in one message; the rest are counted.
_SHOWN: Final = 4

PairKey = tuple[str, str]  # (pod uid, claim key)
# What a claim waits for: (pool, device, share ID, pending conditions) per device.
Waits = tuple[tuple[str, str, str, tuple[str, ...]], ...]


def waits_of(claim: CachedClaim) -> Waits:
    return tuple(sorted((b.pool, b.device, b.share_id, b.pending) for b in claim.binding_pending))


def _stamp(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _what(condition: str) -> str:
    """When the plugin sets ``condition``, and what its log says."""
    if condition == PARTITION_READY_CONDITION:
        return (
            f"{condition} once it has created the MIG partition (its log says whether "
            "creating it failed or is slow)"
        )
    if condition == TENANT_READY_CONDITION:
        return (
            f"{condition} once it has decided which namespace the shared GPU serves (its log "
            "has the GPU's tenant decision and any refused status write)"
        )
    return f"{condition} (its log says why it has not)"


def _devices(bindings: tuple[DeviceBinding, ...]) -> str:
    parts = [
        f"{', '.join(b.pending)} of device {b.device}"
        + (f" (share {b.share_id})" if b.share_id else "")
        + f" on node {b.pool}"
        for b in bindings[:_SHOWN]
    ]
    more = len(bindings) - _SHOWN
    if more > 0:
        parts.append(f"{more} more device{'s' if more > 1 else ''}")
    return "; ".join(parts)


def _advice(bindings: tuple[DeviceBinding, ...], claim_key: str) -> str:
    nodes = sorted({b.pool for b in bindings})
    conditions = sorted({c for b in bindings for c in b.pending})
    return (
        f"flexgpu's kubelet plugin on node {', '.join(nodes)} sets "
        f"{', and '.join(_what(c) for c in conditions)}. Check that the flexgpu kubelet plugin "
        f"pod on {'that node' if len(nodes) == 1 else 'those nodes'} is running, and its log "
        f"for claim {claim_key}. The scheduler gives up after its binding timeout (600 s by "
        "default) and schedules the pod again."
    )


def _since(since: datetime | None, wall: datetime, known: bool) -> str:
    if since is None:
        return "allocated at a time the API server did not record"
    waited = human_duration((wall - since).total_seconds())
    what = "allocated" if known else "seen allocated"
    return f"{what} at {_stamp(since)}, {waited} ago"


def wait_message(
    claim: CachedClaim, since: datetime | None, wall: datetime, *, pod: PodRecord | None = None
) -> str:
    """The words of the Event (and of ``flexgpu explain``) for a claim whose binding
    conditions are pending; ``pod``: the pod's view, else the claim's."""
    bindings = claim.binding_pending
    when = _since(since, wall, claim.allocated_at is not None)
    several = len(bindings) > 1 or any(len(b.pending) > 1 for b in bindings)
    what = f"binding condition{'s' if several else ''} {_devices(bindings)}"
    if pod is not None:
        head = (
            f"Pod {pod.key} is not bound to a node yet: the scheduler waits for flexgpu's "
            f"{what} (claim {claim.model.key}, {when})."
        )
    else:
        head = (
            f"Claim {claim.model.key} waits for flexgpu's {what} ({when}); the pods using it "
            "are not bound until then."
        )
    return f"{head} {_advice(bindings, claim.model.key)}"


@dataclass(frozen=True)
class BindingWait:
    pod: PodRecord
    claim: CachedClaim
    since: datetime  # allocationTimestamp, or when the controller first saw the allocation
    waiting_s: float


def waiting_pods(snapshot: Snapshot, claim: CachedClaim) -> list[PodRecord]:
    """Pods that use ``claim`` and are still without a node, by name."""
    return sorted(
        (
            p
            for p in snapshot.pods.values()
            if not p.node_name
            and not p.deleting
            and p.phase == "Pending"
            and claim.model.key in p.claim_keys()
        ),
        key=lambda p: p.key,
    )


def binding_waits(
    snapshot: Snapshot,
    wall: datetime,
    grace_s: float,
    first_seen: Mapping[tuple[str, Waits], datetime] | None = None,
) -> Iterator[BindingWait]:
    """Pods waiting longer than ``grace_s`` for flexgpu's binding conditions of a claim.
    ``first_seen`` gives, per claim key and what it waits for, when a claim without an
    allocationTimestamp was first seen waiting; such a claim not in it is left out."""
    for key in sorted(snapshot.claims):
        claim = snapshot.claims[key]
        if not claim.binding_pending:
            continue
        since = claim.allocated_at
        if since is None:
            since = (first_seen or {}).get((key, waits_of(claim)))
            if since is None:
                continue
        waited = (wall - since).total_seconds()
        if waited < grace_s:
            continue
        for pod in waiting_pods(snapshot, claim):
            yield BindingWait(pod, claim, since, waited)


@dataclass
class Tracked:
    waits: Waits
    text: str
    emitted_at: float | None = None


@dataclass(frozen=True)
class PassResult:
    waiting: int  # claims waiting past the grace period
    by_condition: Mapping[str, int]  # of those, how many wait for each condition
    emitted: int  # Events recorded in this pass (pod and claim each count)


def pod_target(pod: PodRecord) -> EventTarget:
    return EventTarget("Pod", "v1", pod.namespace, pod.name, pod.uid)


def claim_target(claim: CachedClaim) -> EventTarget:
    model = claim.model
    return EventTarget(
        "ResourceClaim", "resource.k8s.io/v1", model.namespace, model.name, model.uid
    )


class BindingWaits:
    def __init__(
        self,
        sink: EventSink,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        reemit_s: float = DEFAULT_REEMIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self.grace_s = grace_s
        self.reemit_s = reemit_s
        self._clock = clock
        # What each waiting pod and claim was told. A claim gets its own Event once, not
        # once per pod that shares it.
        self._pods: dict[PairKey, Tracked] = {}
        self._claims: dict[str, Tracked] = {}
        # (claim key, what it waits for) -> when first seen so, for claims without an
        # allocationTimestamp; forgotten once the claim waits no more (or for something else).
        self._first_seen: dict[tuple[str, Waits], datetime] = {}

    @property
    def tracked(self) -> dict[PairKey, Tracked]:
        """Waiting pod/claim pairs and what the pod was told."""
        return self._pods

    @property
    def tracked_claims(self) -> dict[str, Tracked]:
        return self._claims

    def forget(self) -> None:
        """Drops all tracking (on losing the lease: the next leader decides what to say)."""
        self._pods.clear()
        self._claims.clear()
        self._first_seen.clear()

    def _note_first_seen(self, snapshot: Snapshot, wall: datetime) -> None:
        seen = {}
        for key, claim in snapshot.claims.items():
            if claim.binding_pending and claim.allocated_at is None:
                waits = (key, waits_of(claim))
                seen[waits] = self._first_seen.get(waits, wall)
        self._first_seen = seen

    def run_pass(self, snapshot: Snapshot, wall: datetime) -> PassResult:
        now = self._clock()
        self._note_first_seen(snapshot, wall)
        pods: dict[PairKey, Tracked] = {}
        claims: dict[str, Tracked] = {}
        waiting: dict[str, CachedClaim] = {}
        emitted = 0
        for item in binding_waits(snapshot, wall, self.grace_s, self._first_seen):
            claim_key = item.claim.model.key
            waiting[claim_key] = item.claim
            if claim_key not in claims:  # told once, not once per pod that shares it
                claims[claim_key], written = self._tell(
                    self._claims.get(claim_key), item, wall, now, for_pod=False
                )
                emitted += written
            pair = (item.pod.uid, claim_key)
            pods[pair], written = self._tell(self._pods.get(pair), item, wall, now, for_pod=True)
            emitted += written
        self._pods, self._claims = pods, claims
        by_condition = dict.fromkeys(KNOWN_CONDITIONS, 0)
        for claim in waiting.values():
            for condition in sorted({c for b in claim.binding_pending for c in b.pending}):
                by_condition[condition] = by_condition.get(condition, 0) + 1
        return PassResult(len(waiting), by_condition, emitted)

    def _tell(
        self,
        tracked: Tracked | None,
        item: BindingWait,
        wall: datetime,
        now: float,
        *,
        for_pod: bool,
    ) -> tuple[Tracked, int]:
        """Records the Event on the pod or the claim if due; the tracking, Events written."""
        waits = waits_of(item.claim)
        if tracked is None or tracked.waits != waits:
            # New, or waiting for something else: new words. Unchanged: the words first
            # written, so a repeat keeps the Event's name and bumps its count.
            pod = item.pod if for_pod else None
            tracked = Tracked(waits, wait_message(item.claim, item.since, wall, pod=pod))
        if tracked.emitted_at is not None and now - tracked.emitted_at < self.reemit_s:
            return tracked, 0
        target = pod_target(item.pod) if for_pod else claim_target(item.claim)
        if not self._emit(target, tracked.text, repeat=tracked.emitted_at is not None):
            return tracked, 0  # the next pass tries again
        tracked.emitted_at = now
        return tracked, 1

    def _emit(self, target: EventTarget, text: str, *, repeat: bool) -> bool:
        try:
            self._sink.emit(target, REASON, text, repeat=repeat)
        except Exception as err:  # one failed write must not stop the pass
            log.warning("cannot record an Event on %s %s: %s", target.kind, target.name, err)
            return False
        metrics.BINDING_WAIT_EVENTS.labels(kind=target.kind).inc()
        log.info("%s %s %s/%s: %s", REASON, target.kind, target.namespace, target.name, text)
        return True
