"""Which holders of the nodes node steering ranks may be moved, so that it steers first the
nodes eviction can empty (``driver.allocation.node_clearing``: a node of movable holders
before one that holds a Job).

A claim may move when its pod would be evicted were it alone on the node
(``driver.allocation.consolidation``: its owner consented, its controller makes it again, the
claim was generated for it), or its pod is ending anyway. The cache holds only pods that wait
for a node, so holders' pods are read from the API server: once per claim (a generated
claim's pod never changes; what the pod says of consent is read again after ``REREAD_S``),
at most ``MAX_READS`` a pass, the rest taken as pinned until a later pass has read them.
A ranking from a slightly old read costs at most a less useful steering: eviction itself
reads every pod again before it evicts anyone. Budgets come from the watch each time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.place_eviction import READ_ERRORS
from flexgpu.controller.pod_eviction import BudgetReader, PodReader, read_holder
from flexgpu.controller.records import PodRecord
from flexgpu.driver.allocation.consolidation import plan_gpu

log = logging.getLogger(__name__)

MAX_READS: Final = 20  # pod reads a pass, so a new leader's first pass stays short
REREAD_S: Final = 300.0  # an owner may take consent back (the annotation set to "false")


class _NoReads:
    """Answers from the reads already made; a pod not read yet counts as not there."""

    def __init__(self, known: Mapping[str, PodRecord]) -> None:
        self._known = known

    def read(self, namespace: str, name: str) -> PodRecord | None:
        return self._known.get(f"{namespace}/{name}")


class HolderConsent:
    def __init__(
        self,
        pods: PodReader,
        budgets: BudgetReader,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pods = pods
        self._budgets = budgets
        self._clock = clock
        # claim uid -> (when read, the pod as read: None when there was none)
        self._read: dict[str, tuple[float, PodRecord | None]] = {}

    def forget(self) -> None:
        self._read.clear()

    def movable(self, snapshot: Snapshot, claim_keys: Iterable[str]) -> frozenset[str]:
        """The claims of ``claim_keys`` whose pods eviction may move now."""
        if not self._budgets.synced():
            return frozenset()  # a pod a budget selects would be taken for one that did not
        now = self._clock()
        claims = [snapshot.claims[k] for k in sorted(set(claim_keys)) if k in snapshot.claims]
        wanted = {c.model.uid for c in claims}
        self._read = {uid: seen for uid, seen in self._read.items() if uid in wanted}
        reads = 0
        found: set[str] = set()
        for claim in claims:
            if claim.owner_pod is None:
                continue  # made by name: it stays allocated when its pod goes
            seen = self._read.get(claim.model.uid)
            if seen is None or now - seen[0] >= REREAD_S:
                if reads >= MAX_READS:
                    continue
                reads += 1
                try:
                    pod = self._pods.read(claim.model.namespace, claim.owner_pod[0])
                except READ_ERRORS as err:
                    log.info("reading the pod of claim %s: %s", claim.model.key, err)
                    continue  # pinned for this pass; read again at the next
                seen = (now, pod)
                self._read[claim.model.uid] = seen
            pod = seen[1]
            known = {} if pod is None else {pod.key: pod}
            holder, _ = read_holder(claim, _NoReads(known), self._budgets)
            if not plan_gpu([holder]).waits_for:  # moves, is ending, or its pod is gone
                found.add(claim.model.key)
        return frozenset(found)
