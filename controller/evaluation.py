"""One claim judged against a snapshot, for the pod that waits for it (or for any pod)."""

from __future__ import annotations

from dataclasses import dataclass

from controller.cluster_state import Snapshot
from controller.pod_nodes import NodeFit, node_fit
from controller.records import ClaimRecord, PodRecord
from driver.allocation import Explanation, explain_claim


@dataclass(frozen=True)
class Evaluation:
    claim: ClaimRecord
    pod: PodRecord | None
    fit: NodeFit | None  # None without a pod: every node counts
    explanation: Explanation

    @property
    def satisfiable(self) -> bool:
        return self.explanation.outcome == "allocatable"


def evaluate(snapshot: Snapshot, claim: ClaimRecord, pod: PodRecord | None = None) -> Evaluation:
    fit = node_fit(pod, snapshot.nodes.values()) if pod is not None else None
    explanation = explain_claim(
        claim.model,
        list(snapshot.slices.values()),
        snapshot.classes,
        [c.model for c in snapshot.claims.values()],
        [n.model for n in snapshot.nodes.values()],
        usable_nodes=fit.usable if fit is not None else None,
    )
    return Evaluation(claim=claim, pod=pod, fit=fit, explanation=explanation)
