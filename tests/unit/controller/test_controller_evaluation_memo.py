"""Pending claims that ask the same of the same nodes share one explanation per snapshot, each
still named as itself; anything that could change the explanation is not shared."""

from __future__ import annotations

from controller_builders import A, claim, node, node_slices, pod, request, snapshot

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.evaluation import Memo, evaluate

L4 = f'{A}.productName == "NVIDIA L4"'
H100 = f'{A}.productName == "NVIDIA H100 80GB HBM3"'


def _cluster() -> Snapshot:
    return snapshot(
        slices=node_slices("l4", "l4-2-pcie"),
        nodes=[node("l4", {"zone": "a"}), node("other", {"zone": "b"})],
        claims=[
            claim("one", request("gpu.flexgpu.dev", 1, H100)),
            claim("two", request("gpu.flexgpu.dev", 1, H100)),
            claim("three", request("gpu.flexgpu.dev", 1, L4)),
        ],
        pods=[
            pod("p1", "one", node_selector={"zone": "a"}),
            pod("p2", "two", node_selector={"zone": "a"}),
            pod("p3", "two", node_selector={"zone": "b"}),
            pod("p4", "three", node_selector={"zone": "a"}),
        ],
    )


def test_same_claim_spec_and_node_set_share_one_explanation_named_per_claim() -> None:
    snap = _cluster()
    memo = Memo()
    claims, pods = snap.claims, snap.pods
    first = evaluate(snap, claims["ns/one"], pods["ns/p1"], memo=memo)
    second = evaluate(snap, claims["ns/two"], pods["ns/p2"], memo=memo)
    alone = evaluate(snap, claims["ns/two"], pods["ns/p2"])
    assert len(memo.explanations) == 1
    assert second.explanation.requests is first.explanation.requests  # shared, not recomputed
    assert second.explanation == alone.explanation  # and what it would have been on its own
    assert second.explanation.message.startswith("Claim ns/two ")
    assert first.explanation.message.startswith("Claim ns/one ")


def test_other_nodes_or_other_requests_get_their_own_explanation() -> None:
    snap = _cluster()
    memo = Memo()
    claims, pods = snap.claims, snap.pods
    evaluate(snap, claims["ns/two"], pods["ns/p2"], memo=memo)
    elsewhere = evaluate(snap, claims["ns/two"], pods["ns/p3"], memo=memo)
    l4 = evaluate(snap, claims["ns/three"], pods["ns/p4"], memo=memo)
    assert len(memo.explanations) == 3
    assert elsewhere.explanation.outcome == "unallocatable"  # zone b has no GPU node
    assert l4.explanation.outcome == "allocatable"


def test_a_new_snapshot_starts_a_new_memo() -> None:
    memo = Memo()
    for _ in range(2):
        snap = _cluster()
        claims, pods = snap.claims, snap.pods
        evaluate(snap, claims["ns/one"], pods["ns/p1"], memo=memo)
        assert memo.snapshot is snap and len(memo.explanations) == 1
