"""One claim judged against a snapshot, for the pod that waits for it (or for any pod)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.pod_nodes import NodeFit, node_fit
from flexgpu.controller.records import CachedClaim, PodRecord
from flexgpu.driver.allocation import AllocatedState, Explanation, explain_claim
from flexgpu.driver.allocation.explain_text import for_claim
from flexgpu.driver.allocation.selectors import SelectorCache


@dataclass(frozen=True)
class Evaluation:
    claim: CachedClaim
    pod: PodRecord | None
    fit: NodeFit | None  # None without a pod: every node counts
    explanation: Explanation

    @property
    def satisfiable(self) -> bool:
        return self.explanation.outcome == "allocatable"


@dataclass
class Memo:
    """What one snapshot's evaluations share. Pending pods come in crowds made from one
    template (a Deployment, a Job): their claims ask for the same devices and their pods may
    use the same nodes, so they get the same explanation, made once. An unallocated claim's
    explanation depends only on its requests and constraints, the nodes its pod may use and
    the snapshot; which nodes a pod may use depends only on its node selector, required
    affinity and tolerations."""

    snapshot: Snapshot | None = None
    fits: dict[str, NodeFit] = field(default_factory=dict)
    explanations: dict[tuple[str, tuple[str, ...] | None], Explanation] = field(
        default_factory=dict
    )

    def for_snapshot(self, snapshot: Snapshot) -> Memo:
        if self.snapshot is not snapshot:
            self.snapshot, self.fits, self.explanations = snapshot, {}, {}
        return self


def _pod_key(pod: PodRecord) -> str:
    return repr((sorted(pod.node_selector.items()), pod.affinity, pod.tolerations))


def _claim_key(claim: CachedClaim) -> str:
    return repr((claim.model.requests, claim.model.constraints))


def evaluate(
    snapshot: Snapshot,
    claim: CachedClaim,
    pod: PodRecord | None = None,
    selectors: SelectorCache | None = None,
    state: AllocatedState | None = None,
    *,
    memo: Memo | None = None,
) -> Evaluation:
    """``selectors``: a cache shared by the explanations of one ``slices_revision``;
    ``state``: what the snapshot's claims hold, computed once per snapshot; ``memo``: shared
    by the evaluations of one snapshot (see ``Memo``)."""
    if memo is not None:
        memo = memo.for_snapshot(snapshot)
    fit = None
    if pod is not None:
        pod_key = _pod_key(pod) if memo is not None else ""
        fit = memo.fits.get(pod_key) if memo is not None else None
        if fit is None:
            fit = node_fit(pod, snapshot.nodes.values())
            if memo is not None:
                memo.fits[pod_key] = fit
    key = (_claim_key(claim), fit.usable if fit is not None else None)
    if memo is not None and claim.model.allocation is None:
        known = memo.explanations.get(key)
        if known is not None:
            return Evaluation(claim, pod, fit, for_claim(known, claim.model.key))
    explanation = explain_claim(
        claim.model,
        snapshot.slice_list,
        snapshot.classes,
        snapshot.claim_models,
        snapshot.node_models,
        usable_nodes=fit.usable if fit is not None else None,
        selectors=selectors,
        state=state,
        index=snapshot.slice_index,
    )
    if memo is not None and claim.model.allocation is None:
        memo.explanations[key] = explanation
    return Evaluation(claim=claim, pod=pod, fit=fit, explanation=explanation)
