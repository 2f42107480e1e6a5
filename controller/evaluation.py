"""One claim judged against a snapshot, for the pod that waits for it (or for any pod)."""

from __future__ import annotations

from dataclasses import dataclass

from controller.cluster_state import Snapshot
from controller.pod_nodes import NodeFit, node_fit
from controller.records import ClaimRecord, PodRecord
from driver.allocation import AllocatedState, Explanation, explain_claim
from driver.allocation.allocator import SelectorCache


@dataclass(frozen=True)
class Evaluation:
    claim: ClaimRecord
    pod: PodRecord | None
    fit: NodeFit | None  # None without a pod: every node counts
    explanation: Explanation

    @property
    def satisfiable(self) -> bool:
        return self.explanation.outcome == "allocatable"


def evaluate(
    snapshot: Snapshot,
    claim: ClaimRecord,
    pod: PodRecord | None = None,
    selectors: SelectorCache | None = None,
    state: AllocatedState | None = None,
) -> Evaluation:
    """``selectors``: a cache shared by the explanations of one ``slices_revision``;
    ``state``: what the snapshot's claims hold, computed once per snapshot."""
    fit = node_fit(pod, snapshot.nodes.values()) if pod is not None else None
    explanation = explain_claim(
        claim.model,
        list(snapshot.slices.values()),
        snapshot.classes,
        [c.model for c in snapshot.claims.values()],
        [n.model for n in snapshot.nodes.values()],
        usable_nodes=fit.usable if fit is not None else None,
        selectors=selectors,
        state=state,
    )
    return Evaluation(claim=claim, pod=pod, fit=fit, explanation=explanation)
