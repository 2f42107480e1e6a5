"""Evicting the pods that may move from a GPU that has been steered too long, for the claim
that waits for it (leader only).

Called by ``controller.clearing`` after the pass has ended the steerings whose claim was
placed or gone, so eviction only ever serves a claim that still waits. Each GPU being cleared
is one place for the shared engine (``controller.place_eviction``), which decides and evicts
as it does for node steering's nodes: only pods whose owners consented, made again by their
controller, whose claims go with them and fit elsewhere now, every holder of the GPU or none,
at most ``max_in_flight`` at once (a bound of its own, apart from node steering's), through
the Eviction API. The waiting claim is told which holders keep the GPU, and of each eviction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Final, Protocol

from prometheus_client import Counter, Gauge

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.place_eviction import (
    BLOCKED_RETRY_S,
    DEFAULT_MAX_IN_FLIGHT,
    Place,
    PlaceEvictions,
    Said,
)
from flexgpu.controller.pod_eviction import (
    ApiPods,
    BudgetReader,
    EvictionSink,
    PodEvictor,
    PodReader,
)

__all__ = [
    "BLOCKED",
    "BLOCKED_RETRY_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "EVICTED",
    "EVICTIONS",
    "IN_FLIGHT",
    "REFUSED",
    "WAITS",
    "ApiPods",
    "Evictions",
    "SteeredGpu",
]

EVICTED: Final = "GpuClearingEviction"
BLOCKED: Final = "GpuClearingEvictionBlocked"
REFUSED: Final = "GpuClearingEvictionRefused"
WAITS: Final = "GpuClearingWaitsForPods"

EVICTIONS: Final = Counter(
    "flexgpu_clearing_evictions",
    "Eviction API calls GPU clearing made for pods that opted in, by outcome: evicted "
    "(accepted), blocked (HTTP 429: a PodDisruptionBudget allows no disruption now), gone "
    "(the pod was deleted or replaced before the call), refused (any other error status)",
    ["outcome"],
)
IN_FLIGHT: Final = Gauge(
    "flexgpu_clearing_evictions_in_flight",
    "Pods holding a GPU being cleared that are being deleted (evicted by the leader or "
    "deleted by anyone), as the leader's cache shows them",
)


class SteeredGpu(Protocol):
    """What eviction reads of a steering (``controller.clearing.Steering``)."""

    claim_uid: str
    claim: str  # namespace/name
    gpu: str  # node/pool/uuid
    since: float  # the clearing's clock


class Evictions:
    def __init__(
        self,
        pods: PodReader,
        evictor: PodEvictor,
        sink: EvictionSink,
        budgets: BudgetReader,
        *,
        after_s: float,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = PlaceEvictions(
            pods,
            evictor,
            sink,
            budgets,
            what="clearing eviction",
            said=Said(EVICTED, BLOCKED, REFUSED, WAITS, EVICTIONS, IN_FLIGHT),
            after_s=after_s,
            max_in_flight=max_in_flight,
            clock=clock,
        )

    @property
    def after_s(self) -> float:
        return self._engine.after_s

    def forget(self) -> None:
        self._engine.forget()

    def run(
        self,
        snapshot: Snapshot,
        steerings: Iterable[SteeredGpu],
        steered_nodes: Iterable[str] = (),
    ) -> None:
        """``steerings``: every GPU being cleared; ``steered_nodes``: the nodes node steering
        keeps new claims off. A moved pod is counted on neither."""
        steerings = list(steerings)
        by_uid = {c.model.uid: c for c in snapshot.claims.values()}
        places = [
            _place(s)
            for s in steerings
            # Placed or gone: nothing is evicted for it (the pass ends such steering first;
            # this holds whatever the caller did).
            if (waiting := by_uid.get(s.claim_uid)) is not None and not waiting.allocated
        ]
        self._engine.run(
            snapshot,
            places,
            cleared_gpus={s.gpu for s in steerings},
            steered_nodes=set(steered_nodes),
        )


def _place(steering: SteeredGpu) -> Place:
    namespace, _, name = steering.claim.partition("/")
    return Place(
        key=steering.claim_uid,
        node=steering.gpu.partition("/")[0],
        gpu=steering.gpu,
        since=steering.since,
        purpose=f"for claim {steering.claim}",
        told=EventTarget(
            "ResourceClaim", "resource.k8s.io/v1", namespace, name, steering.claim_uid
        ),
    )
