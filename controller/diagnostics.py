"""Diagnostics for claims that keep pods Pending: explain, then tell the pod and the claim.

Each pass takes a snapshot, picks the pending claims (``controller.pending``), explains each for
the pod that waits (``controller.evaluation``) and records a Warning Event with the reason
``GpuClaimUnsatisfiable`` on the pod and on the claim (``controller.messages`` words it).

Not spamming: an Event is recorded when a pod/claim pair is first found unsatisfiable, again
when the diagnosis changes (``messages.fingerprint``), and otherwise only after
``reemit_s``. A pair is re-explained only when the cluster changed since its last explanation
and at most every ``recheck_s``, so a large backlog of pending pods does not keep a core busy.
Tracking ends when the pair leaves the pending set: the pod got a node or is gone, or the
claim was allocated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from flexgpu.controller import metrics
from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.evaluation import Memo, evaluate
from flexgpu.controller.events import EventSink, EventTarget
from flexgpu.controller.messages import Lookup, claim_message, fingerprint, pod_message
from flexgpu.controller.pending import PendingClaim, pending_claims
from flexgpu.driver.allocation.selectors import SelectorCache

log = logging.getLogger(__name__)

REASON: Final = "GpuClaimUnsatisfiable"
DEFAULT_RECHECK_S: Final = 10.0
DEFAULT_REEMIT_S: Final = 30 * 60.0

PairKey = tuple[str, str]  # (pod uid, claim key)


@dataclass
class Tracked:
    revision: int
    checked_at: float
    fingerprint: tuple[object, ...] | None = None  # None: found satisfiable
    emitted_at: float | None = None
    pod_text: str = ""
    claim_text: str = ""


@dataclass(frozen=True)
class PassResult:
    pending: int  # pending claims past the delay
    unsatisfiable: int  # of those, how many the evaluator cannot place
    explained: int  # explanations run in this pass
    emitted: int  # Events recorded in this pass (pod and claim each count)


def pod_target(item: PendingClaim) -> EventTarget:
    pod = item.pod
    return EventTarget("Pod", "v1", pod.namespace, pod.name, pod.uid)


def claim_target(item: PendingClaim) -> EventTarget:
    model = item.claim.model
    return EventTarget(
        "ResourceClaim", "resource.k8s.io/v1", model.namespace, model.name, model.uid
    )


class Diagnostics:
    def __init__(
        self,
        sink: EventSink,
        *,
        delay_s: float,
        recheck_s: float = DEFAULT_RECHECK_S,
        reemit_s: float = DEFAULT_REEMIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self.delay_s = delay_s
        self.recheck_s = recheck_s
        self.reemit_s = reemit_s
        self._clock = clock
        self._tracked: dict[PairKey, Tracked] = {}
        # Selector results, valid while no slice changes (see Snapshot.slices_revision).
        self._selectors: tuple[int, SelectorCache] = (-1, SelectorCache())
        # Explanations shared by claims that ask the same within one snapshot.
        self._memo = Memo()

    @property
    def tracked(self) -> dict[PairKey, Tracked]:
        return self._tracked

    def forget(self) -> None:
        """Drops all tracking (on losing the lease: the next leader decides what to say)."""
        self._tracked.clear()

    def _due_for_check(self, tracked: Tracked | None, revision: int, now: float) -> bool:
        if tracked is None:
            return True
        changed = tracked.revision != revision
        return changed and now - tracked.checked_at >= self.recheck_s

    def _selector_cache(self, snapshot: Snapshot) -> SelectorCache:
        revision, cache = self._selectors
        if revision != snapshot.slices_revision:
            cache = SelectorCache()
            self._selectors = (snapshot.slices_revision, cache)
        return cache

    def run_pass(self, snapshot: Snapshot, wall: datetime) -> PassResult:
        now = self._clock()
        selectors = self._selector_cache(snapshot)
        lookup = Lookup(snapshot)
        live: set[PairKey] = set()
        unsatisfiable = explained = emitted = 0
        for item in pending_claims(snapshot, wall, self.delay_s):
            key = (item.pod.uid, item.claim.model.key)
            live.add(key)
            tracked = self._tracked.get(key)
            if self._due_for_check(tracked, snapshot.revision, now):
                started = time.perf_counter()
                ev = evaluate(
                    snapshot, item.claim, item.pod, selectors, lookup.state, memo=self._memo
                )
                metrics.EXPLAIN_SECONDS.observe(time.perf_counter() - started)
                explained += 1
                previous = tracked
                tracked = Tracked(revision=snapshot.revision, checked_at=now)
                if not ev.satisfiable:
                    tracked.fingerprint = fingerprint(ev)
                    tracked.pod_text = pod_message(ev, lookup)
                    tracked.claim_text = claim_message(ev, lookup)
                    if previous is not None and previous.fingerprint == tracked.fingerprint:
                        tracked.emitted_at = previous.emitted_at
                        # Same diagnosis: keep the words already recorded, not new counts.
                        tracked.pod_text, tracked.claim_text = (
                            previous.pod_text,
                            previous.claim_text,
                        )
                self._tracked[key] = tracked
            if tracked is None or tracked.fingerprint is None:
                continue  # the scheduler has not got to it, or it waits for something else
            unsatisfiable += 1
            if tracked.emitted_at is None or now - tracked.emitted_at >= self.reemit_s:
                written = self._emit(item, tracked, repeat=tracked.emitted_at is not None)
                emitted += written
                if written:  # otherwise the next pass tries again
                    tracked.emitted_at = now
        for key in set(self._tracked) - live:
            del self._tracked[key]
        return PassResult(len(live), unsatisfiable, explained, emitted)

    def _emit(self, item: PendingClaim, tracked: Tracked, *, repeat: bool) -> int:
        written = 0
        targets = [(pod_target(item), tracked.pod_text)]
        if not item.claim.extended_resources:  # that claim exists only here: the pod is told
            targets.append((claim_target(item), tracked.claim_text))
        for target, text in targets:
            try:
                self._sink.emit(target, REASON, text, repeat=repeat)
                written += 1
                metrics.DIAGNOSTIC_EVENTS.labels(kind=target.kind).inc()
            except Exception as err:  # one failed write must not stop the pass
                log.warning("cannot record an Event on %s %s: %s", target.kind, target.name, err)
        log.info("%s %s: %s", REASON, item.pod.key, tracked.pod_text)
        return written
