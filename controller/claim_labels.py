"""Labels each allocated ResourceClaim with the node its flexgpu devices are on
(driver/claim_node_label.py), so a GPU node watches only its own claims.

Every replica keeps the set of claims whose label is wrong, from the claim watch it already
runs (no request of its own); the leader writes them, woken by the watch rather than by a
tick, because a node creates on-demand MIG partitions only once it sees the claim and the pod
waits meanwhile. Once the leader has caught up with every claim in its cache it marks its
Lease (``LABELS_LIVE_ANNOTATION``); the nodes rely on labels only while a holder so marked
renews the lease, and watch every claim otherwise (controller down, an older controller).
A leader whose writes keep failing (RBAC, admission) takes the mark back, so the nodes fall
back instead of missing claims.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kubernetes import client

from flexgpu.controller import metrics
from flexgpu.controller.leader import LeaseElector
from flexgpu.driver.claim_node_label import LABELS_LIVE_ANNOTATION, label_patch

log = logging.getLogger(__name__)

# A claim still unlabelled this long after it was seen: the nodes stop relying on labels.
STALE_S: Final = 30.0
RETRY_S: Final = 1.0
HTTP_INVALID: Final = 422
# Answers that mean the claim changed or went (its next watch event says what is wanted), or
# that it cannot be labelled in either form (logged by the API server's reason).
_GONE: Final = frozenset({404, 409, HTTP_INVALID})


@dataclass
class _Wanted:
    namespace: str
    name: str
    patch: dict[str, Any]
    since: float


class ClaimLabeller:
    def __init__(
        self,
        api: client.ApiClient,
        elector: LeaseElector,
        *,
        synced: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._claims = client.ResourceV1Api(api)
        self._elector = elector
        self._synced = synced
        self._clock = clock
        self._lock = threading.Lock()
        self._wanted: dict[str, _Wanted] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="claim-labels", daemon=True)
        self.written = 0

    # -- fed by the claim watch (every replica) -------------------------------------------
    def listed(self, objects: Iterable[Mapping[str, Any]]) -> None:
        now = self._clock()
        with self._lock:
            before = self._wanted
            self._wanted = {}
            for obj in objects:
                self._note(obj, now, before)
        self._wake.set()

    def changed(self, event: str, obj: Mapping[str, Any]) -> None:
        with self._lock:
            if event == "DELETED":
                self._wanted.pop(_key(obj), None)
            else:
                self._note(obj, self._clock(), self._wanted)
        self._wake.set()

    def _note(self, obj: Mapping[str, Any], now: float, before: Mapping[str, _Wanted]) -> None:
        key = _key(obj)
        patch = label_patch(obj)
        if patch is None:
            self._wanted.pop(key, None)
            return
        meta = obj.get("metadata") or {}
        earlier = before.get(key)
        since = earlier.since if earlier is not None else now
        self._wanted[key] = _Wanted(str(meta.get("namespace")), str(meta.get("name")), patch, since)

    def pending(self) -> int:
        with self._lock:
            return len(self._wanted)

    # -- the leader's writes --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(RETRY_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception:  # one bad answer never ends the loop
                log.exception("claim labels: a pass failed; retrying")

    def step(self) -> None:
        """Writes the labels that are wrong (leader only), then marks or unmarks the Lease."""
        if not self._elector.is_leader or not self._synced():
            return
        started = self._clock()
        with self._lock:
            todo = list(self._wanted.items())
        for key, wanted in todo:
            if not self._elector.is_leader or self._stop.is_set():
                return
            try:
                self._write(wanted)
                self.written += 1
                done = True
            except client.ApiException as err:
                done = err.status in _GONE
                if not done:
                    log.warning("claim %s: label not written: %s", key, err.reason or err.status)
            if done:
                with self._lock:
                    if self._wanted.get(key) is wanted:
                        del self._wanted[key]
        self._mark(started)

    def _write(self, wanted: _Wanted) -> None:
        """A JSON merge patch of the label; where the server takes any write of the claim for
        a change of its spec (an opaque config's parameters are compared byte by byte, and a
        Python client stores them with ", " and ": " where the server writes compact JSON:
        kubelet_plugin/claims/claim_status.py), a replace of the claim as just read, whose
        spec goes back in that client's serialisation."""
        try:
            self._claims.patch_namespaced_resource_claim(
                wanted.name, wanted.namespace, wanted.patch, _request_timeout=10
            )
            return
        except client.ApiException as err:
            if err.status != HTTP_INVALID:
                raise
        read: Any = self._claims.read_namespaced_resource_claim(
            wanted.name, wanted.namespace, _preload_content=False, _request_timeout=10
        )
        claim = json.loads(read.data)
        patch = label_patch(claim)
        if patch is None or patch["metadata"]["uid"] != wanted.patch["metadata"]["uid"]:
            return  # already right, or another claim under the name: its event says more
        labels = dict(claim["metadata"].get("labels") or {})
        labels.update(patch["metadata"]["labels"])
        claim["metadata"]["labels"] = {k: v for k, v in labels.items() if v is not None}
        self._claims.replace_namespaced_resource_claim(
            wanted.name, wanted.namespace, claim, _request_timeout=10
        )

    def _mark(self, started: float) -> None:
        now = self._clock()
        with self._lock:
            pending = list(self._wanted.values())
        metrics.CLAIM_LABELS_PENDING.set(len(pending))
        stale = [w for w in pending if now - w.since >= STALE_S]
        marked = LABELS_LIVE_ANNOTATION in self._elector.annotations
        if stale and marked:
            log.warning(
                "claim labels: %d claim(s) unlabelled for %.0f s (e.g. %s/%s); nodes told to "
                "watch every claim until they are written",
                len(stale),
                STALE_S,
                stale[0].namespace,
                stale[0].name,
            )
            self._elector.annotations.pop(LABELS_LIVE_ANNOTATION, None)
        elif not marked and all(w.since >= started for w in pending):
            # Caught up: what is still wanted arrived during this pass.
            log.info("claim labels: every allocated claim labelled; nodes may watch by label")
            self._elector.annotations[LABELS_LIVE_ANNOTATION] = self._elector.identity


def _key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"
