"""Writes ``status.devices`` of prepared claims, so ``kubectl get resourceclaim -o yaml``
tells a user what they got: GPU UUID, product, MIG profile, share limits, and a Ready
condition.

Written from a background thread, so the prepare path (and its latency) never waits on it.
Each write replaces only this node's entries (driver gpu.flexgpu.dev, pool = node) and keeps
other drivers' ones; unprepare removes ours.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from driver.names import DRIVER_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceStatus:
    pool: str
    device: str
    share_id: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Update:
    namespace: str
    name: str
    uid: str
    devices: tuple[DeviceStatus, ...]


class ClaimStatusWriter:
    def __init__(self, api: Any, node_name: str) -> None:
        self._resource = client.ResourceV1Api(api)
        self._manager = f"{DRIVER_NAME}/{node_name}"
        self._node = node_name  # our pool: the entries of this pool are ours
        self._queue: queue.Queue[_Update | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread:
            self._thread.join(timeout=5)

    def prepared(
        self, namespace: str, name: str, uid: str, devices: Sequence[DeviceStatus]
    ) -> None:
        self._queue.put(_Update(namespace, name, uid, tuple(devices)))

    def unprepared(self, namespace: str, name: str, uid: str) -> None:
        self._queue.put(_Update(namespace, name, uid, ()))

    def _run(self) -> None:
        while (update := self._queue.get()) is not None:
            try:
                self.apply(update)
            except client.ApiException as err:
                if err.status not in (404, 409, 422):  # gone or re-created: nothing to say
                    log.warning("claim %s/%s status: %s", update.namespace, update.name, err)
            except Exception as err:  # best effort: status never breaks the plugin
                log.warning("claim %s/%s status: %s", update.namespace, update.name, err)

    def apply(self, update: _Update, attempts: int = 5) -> None:
        """Replaces this node's entries in ``status.devices`` and keeps everyone else's.

        A read-modify-write guarded by resourceVersion rather than server-side apply: apply
        on claims whose allocation carries opaque config parameters is refused by the
        server (it rebuilds status.allocation without them)."""
        for _ in range(attempts):
            response: Any = self._resource.read_namespaced_resource_claim(
                update.name, update.namespace, _preload_content=False
            )
            claim = json.loads(response.data)
            if claim["metadata"].get("uid") != update.uid:
                return  # re-created under the same name: not ours to describe
            status = claim.setdefault("status", {})
            keep = [
                d
                for d in status.get("devices") or []
                if not (d.get("driver") == DRIVER_NAME and d.get("pool") == self._node)
            ]
            status["devices"] = keep + self._entries(update)
            try:
                self._resource.replace_namespaced_resource_claim_status(
                    update.name, update.namespace, claim, field_manager=self._manager
                )
                return
            except client.ApiException as err:
                if err.status != 409:
                    raise
        log.warning(
            "claim %s/%s status: gave up after %d conflicts",
            update.namespace,
            update.name,
            attempts,
        )

    def _entries(self, update: _Update) -> list[dict[str, Any]]:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        entries = []
        for d in update.devices:
            entry: dict[str, Any] = {
                "driver": DRIVER_NAME,
                "pool": d.pool,
                "device": d.device,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Prepared",
                        "message": "prepared on the node",
                        "lastTransitionTime": now,
                    }
                ],
                "data": dict(d.data),
            }
            if d.share_id:
                entry["shareID"] = d.share_id
            entries.append(entry)
        return entries
