"""The Lease elector against an in-memory Lease API with resourceVersion checks."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from flexgpu.controller.leader import LeaseElector


class FakeLeases:
    """create/read/replace/patch of one Lease, optimistic concurrency as the apiserver does."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise client.ApiException(status=503, reason="unavailable")

    def read_namespaced_lease(self, name: str, namespace: str, **_: Any) -> Any:
        self._check()
        if self.spec is None:
            raise client.ApiException(status=404, reason="NotFound")
        return client.V1Lease(
            metadata=client.V1ObjectMeta(name=name, resource_version=str(self.version)),
            spec=client.V1LeaseSpec(
                holder_identity=self.spec.get("holderIdentity"),
                lease_duration_seconds=self.spec.get("leaseDurationSeconds"),
                renew_time=self.spec.get("renewTime"),
                acquire_time=self.spec.get("acquireTime"),
                lease_transitions=self.spec.get("leaseTransitions"),
            ),
        )

    def create_namespaced_lease(self, namespace: str, body: Any, **_: Any) -> None:
        self._check()
        if self.spec is not None:
            raise client.ApiException(status=409, reason="AlreadyExists")
        self.spec, self.version = dict(body["spec"]), self.version + 1

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> None:
        self._check()
        if body["metadata"]["resourceVersion"] != str(self.version):
            raise client.ApiException(status=409, reason="Conflict")
        self.spec, self.version = dict(body["spec"]), self.version + 1

    def patch_namespaced_lease(self, name: str, namespace: str, body: Any, **_: Any) -> None:
        self._check()
        assert self.spec is not None
        self.spec.update(body["spec"])
        self.version += 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _elector(leases: FakeLeases, identity: str, clock: Clock, **kw: Any) -> LeaseElector:
    elector = LeaseElector(
        client.ApiClient(), name="l", namespace="ns", identity=identity, clock=clock, **kw
    )
    elector._api = leases  # type: ignore[assignment]
    return elector


def test_first_candidate_creates_and_the_other_follows_until_expiry() -> None:
    leases, clock = FakeLeases(), Clock()
    changes: list[bool] = []
    a = _elector(leases, "a", clock, on_change=changes.append)
    b = _elector(leases, "b", clock)
    assert a.step() and a.is_leader and changes == [True]
    assert not b.step() and b.holder == "a"
    clock.now += 5
    assert a.step() and not b.step()  # renewed: the record changed, b's timer restarts
    clock.now += 14
    assert not b.step()  # 14 s since b last saw a change: not yet expired
    clock.now += 1
    # a stopped renewing 15 s ago (it was never stepped again): b takes over.
    assert b.step() and leases.spec is not None and leases.spec["holderIdentity"] == "b"
    assert leases.spec["leaseTransitions"] == 1
    assert not a.step() and changes == [True, False]


def test_racing_candidates_cannot_both_win() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = _elector(leases, "a", clock), _elector(leases, "b", clock)
    a.step()
    b.step()
    clock.now += 20  # a is gone; b sees expiry
    stale = leases.read_namespaced_lease("l", "ns")
    leases.spec = {**(leases.spec or {}), "holderIdentity": "c"}  # c writes first ...
    leases.version += 1
    original_read = leases.read_namespaced_lease
    leases.read_namespaced_lease = lambda *a_, **k: stale  # type: ignore[method-assign]
    # ... so b's replace carries an old resourceVersion and loses.
    assert not b.try_acquire_or_renew()
    leases.read_namespaced_lease = original_read  # type: ignore[method-assign]
    assert leases.spec["holderIdentity"] == "c"


def test_holder_demotes_itself_when_it_cannot_renew() -> None:
    leases, clock = FakeLeases(), Clock()
    a = _elector(leases, "a", clock)
    assert a.step()
    leases.down = True
    clock.now += 5
    assert a.step()  # one failed renewal is within the deadline
    clock.now += 5
    assert not a.step() and not a.is_leader  # 10 s without renewal: stop before others start


def test_release_hands_over_at_the_next_look() -> None:
    leases, clock = FakeLeases(), Clock()
    a, b = _elector(leases, "a", clock), _elector(leases, "b", clock)
    a.step()
    b.step()
    a.release()
    assert not a.is_leader
    assert b.step() and leases.spec is not None and leases.spec["holderIdentity"] == "b"


def test_deadline_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        _elector(FakeLeases(), "a", Clock(), duration_s=10, renew_deadline_s=10)
