"""Writes ``status.devices`` of prepared claims, so ``kubectl get resourceclaim -o yaml``
tells a user what they got: GPU UUID, product, MIG profile, share limits, and a Ready
condition.

Written from a background thread with server-side apply under a field manager per node: the
prepare path (and its latency) never waits on it, the server merges our entries with other
drivers' (the list is keyed by driver, pool, device and share id), and unprepare removes
exactly ours by applying an empty list.
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

_APPLY = "application/apply-patch+yaml"


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

    def apply(self, update: _Update) -> None:
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
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            # The UID guards against writing onto a claim re-created under the same name.
            "metadata": {"name": update.name, "namespace": update.namespace, "uid": update.uid},
            "status": {"devices": entries},
        }
        self._resource.patch_namespaced_resource_claim_status(
            update.name,
            update.namespace,
            json.loads(json.dumps(body)),
            field_manager=self._manager,
            force=True,
            _content_type=_APPLY,
        )
