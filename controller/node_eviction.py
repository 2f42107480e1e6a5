"""Evicting the pods that may move from a node that node steering has kept new claims off for
too long, so that it empties and an autoscaler can remove it (leader only).

Called by ``controller.node_steering`` after its pass has ended and started steerings, over
the nodes steered now: a node whose steering ended (released for a claim, timed out, gone,
no longer chosen) is no place any more, and nothing more is evicted from it. Each node is one
place for the shared engine (``controller.place_eviction``), the one GPU clearing uses: its
holders are every claim allocated a flexgpu device on it; they move only when every one of
them may move (consent, a controller that makes the pod again, a claim generated for the
pod) and every moving pod's claims fit now outside the steered nodes and the GPUs being
cleared, at most ``max_in_flight`` at once (a bound of its own, apart from GPU clearing's).
Where one holder must stay, nobody on the node is moved, and the Node is told which and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from typing import Final, Protocol

from prometheus_client import Counter, Gauge

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.holder_consent import HolderConsent
from flexgpu.controller.place_eviction import DEFAULT_MAX_IN_FLIGHT, Place, PlaceEvictions, Said
from flexgpu.controller.pod_eviction import BudgetReader, EvictionSink, PodEvictor, PodReader

EVICTED: Final = "GpuNodeSteeringEviction"
BLOCKED: Final = "GpuNodeSteeringEvictionBlocked"
REFUSED: Final = "GpuNodeSteeringEvictionRefused"
WAITS: Final = "GpuNodeSteeringWaitsForPods"
PURPOSE: Final = "that flexgpu steers so an autoscaler can remove it"

EVICTIONS: Final = Counter(
    "flexgpu_node_steering_evictions",
    "Eviction API calls node steering made to empty a steered node, by outcome: evicted "
    "(accepted), blocked (HTTP 429: a PodDisruptionBudget allows no disruption now), gone "
    "(the pod was deleted or replaced before the call), refused (any other error status)",
    ["outcome"],
)
IN_FLIGHT: Final = Gauge(
    "flexgpu_node_steering_evictions_in_flight",
    "Pods holding a steered node past the eviction bound that are being deleted (evicted by "
    "the leader or deleted by anyone)",
)


class SteeredNode(Protocol):
    """What eviction reads of a steering (``controller.node_steering.SteeredNode``)."""

    node: str
    since: float  # node steering's clock


class NodeEvictions:
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
            what="node steering eviction",
            said=Said(EVICTED, BLOCKED, REFUSED, WAITS, EVICTIONS, IN_FLIGHT),
            after_s=after_s,
            max_in_flight=max_in_flight,
            clock=clock,
        )
        self._consent = HolderConsent(pods, budgets, clock=clock)

    @property
    def after_s(self) -> float:
        return self._engine.after_s

    def forget(self) -> None:
        self._engine.forget()
        self._consent.forget()

    def movable(self, snapshot: Snapshot, claim_keys: Iterable[str]) -> frozenset[str]:
        """The claims of ``claim_keys`` whose pods may be moved, for steering's ranking."""
        return self._consent.movable(snapshot, claim_keys)

    def run(
        self,
        snapshot: Snapshot,
        steered: Iterable[SteeredNode],
        cleared_gpus: Collection[str] = (),
    ) -> None:
        """``steered``: every node being steered now; ``cleared_gpus``: the GPUs (as
        node/pool/uuid) GPU clearing keeps new claims off. A moved pod is counted on
        neither."""
        steered = list(steered)
        self._engine.run(
            snapshot,
            [_place(s) for s in steered],
            cleared_gpus=set(cleared_gpus),
            steered_nodes={s.node for s in steered},
        )


def _place(steered: SteeredNode) -> Place:
    return Place(
        key=steered.node,
        node=steered.node,
        gpu=None,
        since=steered.since,
        purpose=PURPOSE,
        told=EventTarget("Node", "v1", "", steered.node, ""),
    )
