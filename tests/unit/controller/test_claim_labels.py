"""The controller's claim labeller: every replica tracks the claims whose node label is wrong
from its watch, only the leader writes, the Lease is marked once the leader has caught up and
unmarked when writes keep failing; and the elector carries the mark only within one term."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from kubernetes import client

from flexgpu.controller.claim_labels import STALE_S, ClaimLabeller
from flexgpu.driver.claim_node_label import CLAIM_NODE_LABEL, LABELS_LIVE_ANNOTATION
from flexgpu.driver.names import DRIVER_NAME
from tests.unit.controller.test_controller_leader import Clock, FakeLeases, _elector


def claim(name: str, pool: str | None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "labels": labels}
    }
    if pool:
        result = {"driver": DRIVER_NAME, "pool": pool, "device": "gpu-0", "request": "r"}
        obj["status"] = {"allocation": {"devices": {"results": [result]}}}
    return obj


class FakeClaims:
    def __init__(self) -> None:
        self.patches: list[tuple[str, str, Any]] = []
        self.replaced: list[Any] = []
        self.fail: list[int] = []
        self.stored: dict[str, Any] = {}  # name -> the claim a read returns

    def read_namespaced_resource_claim(self, name: str, namespace: str, **_: Any) -> Any:
        return SimpleNamespace(data=json.dumps(self.stored[name]).encode())

    def replace_namespaced_resource_claim(
        self, name: str, namespace: str, body: Any, **_: Any
    ) -> None:
        self.replaced.append(body)

    def patch_namespaced_resource_claim(
        self, name: str, namespace: str, body: Any, **_: Any
    ) -> None:
        if self.fail:
            raise client.ApiException(status=self.fail.pop(0), reason="refused")
        self.patches.append((namespace, name, body))


def labeller(leader: bool = True) -> tuple[ClaimLabeller, FakeClaims, Any, Clock]:
    elector = SimpleNamespace(is_leader=leader, annotations={}, identity="c-1")
    clock = Clock()
    made = ClaimLabeller(
        client.ApiClient(),
        elector,  # type: ignore[arg-type]
        synced=lambda: True,
        clock=clock,
    )
    claims = FakeClaims()
    made._claims = claims  # type: ignore[assignment]
    return made, claims, elector, clock


def test_the_leader_labels_allocated_claims_and_marks_the_lease_once_caught_up() -> None:
    made, claims, elector, _ = labeller()
    made.listed([claim("a", "n1"), claim("b", None), claim("c", "n2", {CLAIM_NODE_LABEL: "n2"})])
    assert made.pending() == 1
    made.step()
    assert claims.patches == [
        ("ns", "a", {"metadata": {"uid": "uid-a", "labels": {CLAIM_NODE_LABEL: "n1"}}})
    ]
    assert made.pending() == 0
    assert elector.annotations == {LABELS_LIVE_ANNOTATION: "c-1"}


def test_a_follower_tracks_but_never_writes_nor_marks() -> None:
    made, claims, elector, _ = labeller(leader=False)
    made.listed([claim("a", "n1")])
    made.step()
    assert claims.patches == [] and made.pending() == 1 and elector.annotations == {}
    elector.is_leader = True  # it takes over: its cache already knows what is wanted
    made.step()
    assert [p[1] for p in claims.patches] == ["a"]


def test_a_moved_claim_is_relabelled_and_a_deallocated_one_unlabelled() -> None:
    made, claims, _, _ = labeller()
    made.listed([])
    made.changed("MODIFIED", claim("a", "n2", {CLAIM_NODE_LABEL: "n1"}))
    made.changed("MODIFIED", claim("b", None, {CLAIM_NODE_LABEL: "n1"}))
    made.changed("ADDED", claim("c", "n1"))
    made.changed("DELETED", claim("c", "n1"))
    made.step()
    labels = {n: body["metadata"]["labels"][CLAIM_NODE_LABEL] for _, n, body in claims.patches}
    assert labels == {"a": "n2", "b": None}


def test_a_claim_gone_or_changed_is_dropped_and_a_refused_write_retried() -> None:
    made, claims, _, _ = labeller()
    made.listed([claim("gone", "n1"), claim("refused", "n1")])
    claims.fail = [404, 403]  # in key order: ns/gone, then ns/refused
    made.step()
    assert made.pending() == 1 and claims.patches == []
    made.step()
    assert [p[1] for p in claims.patches] == ["refused"] and made.pending() == 0


def test_writes_failing_for_long_take_the_mark_back() -> None:
    made, claims, elector, clock = labeller()
    made.listed([])
    made.step()
    assert LABELS_LIVE_ANNOTATION in elector.annotations
    made.changed("ADDED", claim("a", "n1"))
    claims.fail = [403, 403]
    made.step()
    assert LABELS_LIVE_ANNOTATION in elector.annotations  # young: nodes keep relying
    clock.now += STALE_S
    made.step()
    assert elector.annotations == {}  # nodes go back to watching every claim
    made.step()  # written now
    assert made.pending() == 0 and elector.annotations == {LABELS_LIVE_ANNOTATION: "c-1"}


class AnnotatedLeases(FakeLeases):
    """Also keeps the Lease's annotations as the last write sent them."""

    annotations: dict[str, str] | None = None

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kw: Any) -> None:
        super().replace_namespaced_lease(name, namespace, body, **kw)
        self.annotations = body["metadata"].get("annotations")


def test_the_elector_writes_the_mark_with_renewals_and_drops_it_on_takeover() -> None:
    leases, clock = AnnotatedLeases(), Clock()
    a = _elector(leases, "a", clock)
    b = _elector(leases, "b", clock)
    assert a.step()
    a.annotations[LABELS_LIVE_ANNOTATION] = "a"
    a.step()
    assert leases.annotations == {LABELS_LIVE_ANNOTATION: "a"}
    assert not b.step()  # b follows
    b.annotations[LABELS_LIVE_ANNOTATION] = "b"  # a stale mark from an earlier term
    clock.now += 20  # a stops renewing; b takes over
    assert b.step()
    assert leases.annotations is None and b.annotations == {}


def test_a_claim_the_server_will_not_patch_is_replaced_as_read_with_the_label() -> None:
    """A claim whose opaque parameters a Python client stored (", ") takes any patch for a
    spec change (422): it is replaced as just read, its other labels kept."""
    made, claims, _, _ = labeller()
    stored = claim("a", "n1", {"team": "x"})
    stored["spec"] = {"devices": {"config": [{"opaque": {"parameters": {"a": 1, "b": 2}}}]}}
    claims.stored["a"] = stored
    made.listed([stored])
    claims.fail = [422]
    made.step()
    assert claims.patches == []
    (body,) = claims.replaced
    assert body["metadata"]["labels"] == {"team": "x", CLAIM_NODE_LABEL: "n1"}
    assert body["spec"] == stored["spec"] and made.pending() == 0
