"""Which ResourceClaims a node's claim watch asks for: only those labelled with this node
(driver/claim_node_label.py) while the controller's Lease says it labels them, every claim
otherwise.

The Lease is watched by name (one small object, renewed every few seconds), so the scope
follows the controller: it narrows once the leader has labelled every allocated claim, and
widens again when labels have not been live for ``WIDEN_AFTER_S``: the lease stops being
renewed (controller down) or its holder takes the mark back (its label writes fail). Not at
once: a leader handover or rolling restart (about 15 s) would otherwise make every node of
the cluster list every claim twice; a claim allocated meanwhile waits for the next leader's
first pass, which labels it. A node never relies for long on a label nobody writes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from flexgpu.driver.claim_node_label import labels_live, node_selector
from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects

LEASE_SYNC_S = 2.0
# Labels not live for this long: the node watches every claim.
WIDEN_AFTER_S = 120.0


class ClaimScope:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        lease: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        now: Callable[[], datetime | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        widen_after_s: float = WIDEN_AFTER_S,
    ) -> None:
        """``lease`` is "<namespace>/<name>"; "" keeps the scope at every claim."""
        self._selector = node_selector(node_name)
        self._now = now
        self._clock = clock
        self._widen_after_s = widen_after_s
        self._live_at: float | None = None  # when labels were last found live
        self._api = api
        self._on_change = on_change
        self._lease_name = lease
        self._lease: WatchedObjects | None = None

    def _new_watch(self) -> WatchedObjects:
        namespace, _, name = self._lease_name.partition("/")
        return WatchedObjects(
            self._api,
            path_of("apis", "coordination.k8s.io", "v1", "namespaces", namespace, "leases"),
            query={"fieldSelector": f"metadata.name={name}"},
            on_change=self._on_change,
            name=f"lease {self._lease_name} (claim labels)",
        )

    def start(self) -> None:
        if self._lease_name and self._lease is None:
            self._lease = self._new_watch()  # a stopped watch does not start again
            self._lease.start()
            # Briefly: the claim watch then starts in the right scope instead of listing
            # every claim of the cluster only to narrow a moment later.
            self._lease.wait_synced(LEASE_SYNC_S)

    def stop(self) -> None:
        if self._lease is not None:
            self._lease.stop()
            self._lease = None

    def query(self) -> dict[str, str]:
        """The list/watch query for this node's claims now."""
        if self._lease is None or not self._lease.synced:
            return {}
        now = self._clock()
        if labels_live(self._lease.get(self._lease_name), self._now()):
            self._live_at = now
        if self._live_at is not None and now - self._live_at < self._widen_after_s:
            return {"labelSelector": self._selector}
        return {}
