"""The binding-conditions watch asks for this node's labelled claims while the controller's
Lease says claims are labelled, and for every claim once labels have not been live for
WIDEN_AFTER_S (not during a leader handover); it narrows again when they are; with no Lease
configured it watches every claim, as before labels existed."""

from __future__ import annotations

import queue
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from flexgpu.driver.claim_node_label import LABELS_LIVE_ANNOTATION, node_selector
from flexgpu.kubelet_plugin.agents.binding_watch import CLAIMS, BindingWatch
from flexgpu.kubelet_plugin.api.claim_scope import WIDEN_AFTER_S
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import NODE, ClaimTable, Node

LEASES = "/apis/coordination.k8s.io/v1/namespaces/flexgpu/leases"


class QueryLog(FakeKubeApi):
    """Also keeps the query of every list and watch, by path."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[tuple[str, dict[str, str]]] = []

    def get(self, path: str, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        self.queries.append((path, dict(query or {})))
        return super().get(path, query)


def lease(holder: str, mark: str | None, renewed: datetime) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "ctl",
            "namespace": "flexgpu",
            "annotations": {LABELS_LIVE_ANNOTATION: mark} if mark else {},
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }


def claim_queries(api: QueryLog) -> list[str]:
    """The label selector of each claim list so far ("" for every claim)."""
    return [q.get("labelSelector", "") for path, q in api.queries if path == CLAIMS]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watch_of(
    tmp_path: Path, api: QueryLog, lease_name: str, clock: Clock | None = None
) -> BindingWatch:
    node = Node(tmp_path, ClaimTable())
    node.devices.binding_conditions = True
    node.devices.refresh()
    api.lists[CLAIMS] = []
    return BindingWatch(
        api,  # type: ignore[arg-type]
        NODE,
        early=EarlyPartitions(node.preparer),
        status=ClaimStatusWriter(api, NODE),  # type: ignore[arg-type]
        devices=node.devices,
        republish=lambda: None,
        failure_s=60,
        labels_lease=lease_name,
        clock=clock or Clock(),
    )


def lease_events(api: QueryLog) -> queue.Queue[Any]:
    while True:
        events = api.watches.get(timeout=5)
        if api.watched_paths[id(events)] == LEASES:
            return events


def test_a_node_watches_its_labelled_claims_while_the_lease_is_marked_then_all(
    tmp_path: Path,
) -> None:
    api = QueryLog()
    now = datetime.now(UTC)
    api.lists[LEASES] = [lease("c-1", "c-1", now)]
    clock = Clock()
    watch = watch_of(tmp_path, api, "flexgpu/ctl", clock)
    try:
        watch.ensure_watch()
        assert watch.claims.wait_synced(5)
        assert claim_queries(api) == [node_selector(NODE)]  # never a cluster-wide list first
        events = lease_events(api)
        # A new leader has not caught up yet: a handover's while, the node stays narrow.
        events.put(("MODIFIED", lease("c-2", None, datetime.now(UTC))))
        wait_for(
            lambda: (
                watch.scope._lease
                and watch.scope._lease.items()[0]["spec"]["holderIdentity"] == "c-2"
            ),
            timeout_s=5,
        )
        clock.now += WIDEN_AFTER_S - 1
        watch.ensure_watch()
        assert claim_queries(api) == [node_selector(NODE)]
        # Labels not live for WIDEN_AFTER_S: every claim again.
        clock.now += 1
        assert watch.scope.query() == {}
        watch.ensure_watch()
        wait_for(lambda: claim_queries(api)[-1:] == [""], timeout_s=5)
        events.put(("MODIFIED", lease("c-2", "c-2", datetime.now(UTC))))
        wait_for(lambda: watch.scope.query() != {}, timeout_s=5)
        watch.ensure_watch()
        wait_for(lambda: claim_queries(api)[-1:] == [node_selector(NODE)], timeout_s=5)
    finally:
        watch.stop()


def test_a_node_started_while_the_lease_is_stale_watches_every_claim(tmp_path: Path) -> None:
    api = QueryLog()
    api.lists[LEASES] = [lease("c-1", "c-1", datetime.now(UTC) - timedelta(minutes=5))]
    watch = watch_of(tmp_path, api, "flexgpu/ctl")
    try:
        watch.ensure_watch()
        assert watch.claims.wait_synced(5)
        assert claim_queries(api) == [""]
    finally:
        watch.stop()


def test_without_a_lease_every_claim_is_watched_and_no_lease_read(tmp_path: Path) -> None:
    api = QueryLog()
    watch = watch_of(tmp_path, api, "")
    try:
        watch.ensure_watch()
        assert watch.claims.wait_synced(5)
        assert claim_queries(api) == [""]
        assert not [path for path, _ in api.queries if path == LEASES]
    finally:
        watch.stop()
