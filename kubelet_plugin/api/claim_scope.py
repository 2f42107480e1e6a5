"""Which ResourceClaims a node's claim watch asks for: only those labelled with this node
(driver/claim_node_label.py) while the controller's Lease says it labels them, every claim
otherwise.

The Lease is watched by name (one small object, renewed every few seconds), so the scope
follows the controller: it narrows once the leader has labelled every allocated claim, and
widens again when the lease stops being renewed (controller down) or its holder takes the
mark back (its label writes fail). A node never relies on a label nobody writes.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from flexgpu.driver.claim_node_label import labels_live, node_selector
from flexgpu.kubelet_plugin.api.kube_api import KubeApi, path_of
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects

LEASE_SYNC_S = 2.0


class ClaimScope:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        lease: str,
        *,
        on_change: Callable[[], None] = lambda: None,
        now: Callable[[], datetime | None] = lambda: None,
    ) -> None:
        """``lease`` is "<namespace>/<name>"; "" keeps the scope at every claim."""
        self._selector = node_selector(node_name)
        self._now = now
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
        if labels_live(self._lease.get(self._lease_name), self._now()):
            return {"labelSelector": self._selector}
        return {}
