"""Writes ``status.devices`` of prepared claims, so ``kubectl get resourceclaim -o yaml``
tells a user what they got: GPU UUID, product, MIG profile, share limits, and a Ready
condition.

Written from a background thread, so the prepare path (and its latency) never waits on it.
Each write replaces only this node's entries (driver gpu.flexgpu.dev, pool = node) and keeps
other drivers' ones; unprepare removes ours.

Writes are coalesced per claim: a claim's first change opens a short window, and what is
written when it closes is the claim's latest desired state, so several prepares and
unprepares of one claim become at most one write, and a prepare undone within the window
becomes none.

Each write is built from the claim as the server has it: the copy prepare read (or the
previous write returned) when there is one, a fresh read after a conflict or a refusal.
Entries are written only for devices the claim has allocated now: a claim sent back and
allocated anew keeps no entry of its first allocation.

Two forms, because of how the apiserver compares an allocation: an opaque config's
parameters are a RawExtension, compared byte by byte with what it stores, and it stores the
bytes the claim's creator sent. kubectl, helm and every Go client send compact JSON, which is
also what the apiserver itself writes when it applies a patch; the Python client sends ", "
and ": ". So a write is first a JSON merge patch of ``status.devices`` alone, guarded by
resourceVersion, which the server applies to the claim as it stores it; where the server
takes that for an allocation change (the stored bytes are not compact), it is a replace of
the claim as just read, whose allocation goes back in this client's serialisation. A write
refused in both forms (parameters stored in yet another serialisation) is counted
(``refused``) and logged with the server's reason. A refused write is never sent again as it
was; a write that keeps meeting newer claims is retried later, and a binding write is retried
for as long as the scheduler waits for it.
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexgpu.driver.backoff import jittered
from flexgpu.driver.log_format import claim_fields
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.kubelet_plugin.api.kube_api import MERGE_PATCH, ApiError, KubeApi
from flexgpu.kubelet_plugin.claims.claim_objects import ClaimObjects
from flexgpu.kubelet_plugin.claims.claim_source import claim_path

log = logging.getLogger(__name__)

# How long a claim's changes gather before they are written: short enough that a user sees
# the status within a second or so, long enough to fold a quick prepare/unprepare together.
COALESCE_S = 1.0
CONFLICT_ATTEMPTS = 5
# Transient failures (API down, timeouts) are retried with backoff, then given up; a binding
# write (the scheduler holds the pod until it reads it) for about as long as the scheduler
# waits for binding conditions (600 s by default).
FAILURE_ATTEMPTS = 6
BINDING_FAILURE_ATTEMPTS = 25
MAX_BACKOFF_S = 30.0
FLUSH_ON_STOP_S = 5.0


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


PREPARED = Condition("Ready", "True", "Prepared", "prepared on the node")


@dataclass(frozen=True)
class DeviceStatus:
    pool: str
    device: str
    share_id: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    # What the entry's conditions say: prepared, or (binding conditions) a partition made
    # ready or failed before the pod was bound.
    conditions: tuple[Condition, ...] = (PREPARED,)


@dataclass
class _Pending:
    namespace: str
    name: str
    uid: str
    devices: tuple[DeviceStatus, ...]
    due: float
    failures: int = 0
    # A binding condition's outcome: the scheduler waits for it, so it is never given up
    # while the claim exists.
    binding: bool = False


class StillConflicting(Exception):
    """Every attempt of a write met a newer claim: retried later, like an API failure."""


class ClaimStatusWriter:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        objects: ClaimObjects | None = None,
        *,
        coalesce_s: float = COALESCE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._manager = f"{DRIVER_NAME}/{node_name}"
        self._node = node_name  # our pool: the entries of this pool are ours
        self._objects = objects if objects is not None else ClaimObjects()
        self._coalesce_s = coalesce_s
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # When the writer thread wakes up by itself (inf: it waits to be told).
        self._wake_at = float("-inf")
        self.writes = 0  # status writes sent, for tests
        # Writes the server refused even when built from a fresh read (metrics, tests).
        self.refused = 0
        # Claim UID -> why its last write was refused as built from a fresh read.
        self._refusals: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="claim-status", daemon=True)
        self._thread.start()

    def stop(self, flush_s: float = FLUSH_ON_STOP_S) -> None:
        """Writes what is still pending (for at most flush_s), then ends the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join(timeout=flush_s + 1)

    # -- called by the preparer (never blocks on the API) ------------------------------------
    def prepared(
        self, namespace: str, name: str, uid: str, devices: Sequence[DeviceStatus]
    ) -> None:
        self._want(namespace, name, uid, tuple(devices))

    def binding(self, namespace: str, name: str, uid: str, devices: Sequence[DeviceStatus]) -> None:
        """A binding condition's outcome: written at once, since the scheduler holds the pod
        until it reads it."""
        self._want(namespace, name, uid, tuple(devices), delay_s=0.0, binding=True)

    def unprepared(self, namespace: str, name: str, uid: str) -> None:
        self._want(namespace, name, uid, ())

    def _want(
        self,
        namespace: str,
        name: str,
        uid: str,
        devices: tuple[DeviceStatus, ...],
        *,
        delay_s: float | None = None,
        binding: bool = False,
    ) -> None:
        with self._cond:
            self._refusals.pop(uid, None)
            pending = self._pending.get(uid)
            if pending is None:
                due = self._clock() + (self._coalesce_s if delay_s is None else delay_s)
                self._pending[uid] = _Pending(namespace, name, uid, devices, due, binding=binding)
                # The writer needs waking only when this window closes before the one it
                # waits for; under load it waits for an earlier one (each opens coalesce_s
                # from now), and waking it per prepare cost CPU the prepares then lacked.
                if due < self._wake_at:
                    self._cond.notify_all()
            else:
                # The window stays where it opened: a claim that keeps changing is still
                # written promptly, with whatever it wants last.
                pending.devices = devices
                pending.binding = pending.binding or binding
                if delay_s is not None and self._clock() + delay_s < pending.due:
                    pending.due = self._clock() + delay_s
                    self._cond.notify_all()

    # -- writing ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    if not self._pending:
                        self._wake_at = float("inf")
                        self._cond.wait()
                        continue
                    self._wake_at = self._next_due()
                    wait = self._wake_at - self._clock()
                    if wait <= 0:
                        break
                    self._cond.wait(timeout=wait)
                self._wake_at = float("-inf")
                stopping = self._stopping
            if stopping:
                self.flush(deadline=self._clock() + FLUSH_ON_STOP_S)
                return
            self.write_due()

    def _next_due(self) -> float:
        return min((p.due for p in self._pending.values()), default=float("inf"))

    def write_due(self) -> int:
        """Writes every claim whose window has closed; returns how many were handled."""
        now = self._clock()
        with self._cond:
            due = [p for p in self._pending.values() if p.due <= now]
            for p in due:
                del self._pending[p.uid]
        for p in due:
            self._write_one(p)
        return len(due)

    def flush(self, deadline: float | None = None) -> None:
        """Writes everything pending now, windows or not (shutdown, tests)."""
        with self._cond:
            for p in self._pending.values():
                p.due = min(p.due, self._clock())
        while self.write_due():
            if deadline is not None and self._clock() >= deadline:
                return

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def is_pending(self, uid: str) -> bool:
        """Whether a write of the claim is queued (or waits to be retried)."""
        with self._cond:
            return uid in self._pending

    def refusal(self, uid: str) -> str | None:
        """Why the claim's last write was refused (built from a fresh read), if it was."""
        with self._cond:
            return self._refusals.get(uid)

    def _write_one(self, pending: _Pending) -> None:
        try:
            self.apply(pending)
        except ApiError as err:
            if err.status in (404, 422):  # gone, or refused as built from a fresh read
                self._objects.forget(pending.uid)
                if err.status == 422:
                    with self._cond:
                        self.refused += 1
                        self._refusals[pending.uid] = err.message
                # A claim deleted once its pod ended is the normal case, not a problem.
                level = logging.INFO if err.status == 404 else logging.WARNING
                log.log(
                    level,
                    "claim %s/%s status: %s",
                    pending.namespace,
                    pending.name,
                    err,
                    extra=claim_fields(pending.namespace, pending.name, pending.uid),
                )
                return
            self._retry_later(pending, err)
        except Exception as err:  # API unreachable and the like: status never breaks us
            self._retry_later(pending, err)

    def _retry_later(self, pending: _Pending, err: Exception) -> None:
        pending.failures += 1
        attempts = BINDING_FAILURE_ATTEMPTS if pending.binding else FAILURE_ATTEMPTS
        if pending.failures >= attempts:
            log.warning(
                "claim %s/%s status: giving up after %d failures: %s",
                pending.namespace,
                pending.name,
                pending.failures,
                err,
                extra=claim_fields(pending.namespace, pending.name, pending.uid),
            )
            return
        backoff = jittered(min(self._coalesce_s * 2**pending.failures, MAX_BACKOFF_S))
        log.info(
            "claim %s/%s status: %s; retrying in %.1fs",
            pending.namespace,
            pending.name,
            err,
            backoff,
            extra=claim_fields(pending.namespace, pending.name, pending.uid),
        )
        with self._cond:
            newer = self._pending.get(pending.uid)
            if newer is None:
                pending.due = self._clock() + backoff
                self._pending[pending.uid] = pending
                self._cond.notify_all()
            # else: a newer change is queued and will be written in its own window.

    def apply(self, pending: _Pending) -> None:
        """Makes the claim's entries of this node equal to ``pending.devices`` (those still
        allocated) and keeps everyone else's.

        Written as a JSON merge patch of ``status.devices``, guarded by resourceVersion; where
        the server takes that for an allocation change (see the module docstring: opaque
        config parameters stored in another serialisation than its own), as a replace of the
        claim read just before. Raises ApiError (404: the claim is gone; 422: refused in both
        forms, or refused twice in one) or StillConflicting."""
        claim = self._objects.get(pending.uid)
        forms = [self._merge_patch, self._replace]
        refused_once = False
        conflicts = 0
        while conflicts < CONFLICT_ATTEMPTS:
            if claim is None:
                claim = self._api.get(claim_path(pending.namespace, pending.name))
            if (claim.get("metadata") or {}).get("uid") != pending.uid:
                self._objects.forget(pending.uid)
                return  # re-created under the same name: not ours to describe
            wanted = self._entries(self._still_allocated(pending, claim))
            devices = (claim.get("status") or {}).get("devices") or []
            keep = [d for d in devices if not self._ours(d)]
            if _same_entries([d for d in devices if self._ours(d)], wanted):
                self._settled(pending, claim)
                return  # already so (for example a prepare undone before it was written)
            try:
                self.writes += 1
                written = forms[0](pending, claim, keep + wanted)
            except ApiError as err:
                if err.status == 409:
                    conflicts += 1
                    claim = None  # someone else changed it: read it again
                    continue
                if err.status == 422 and _allocation_refused(err) and len(forms) > 1:
                    forms.pop(0)  # the server's own re-serialisation differs: the next form
                    claim = None
                    continue
                if err.status == 422 and not refused_once:
                    # Our copy may no longer match what the server has (a claim allocated
                    # anew): build the write again from a fresh read, once.
                    refused_once = True
                    claim = None
                    continue
                raise
            self._settled(pending, written)
            return
        raise StillConflicting(
            f"every one of {CONFLICT_ATTEMPTS} writes met a newer version of the claim"
        )

    def _merge_patch(
        self, pending: _Pending, claim: Mapping[str, Any], devices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """``status.devices`` alone: the server applies it to the claim as it stores it."""
        version = (claim.get("metadata") or {}).get("resourceVersion")
        return self._api.request(
            "PATCH",
            claim_path(pending.namespace, pending.name, "status"),
            query={"fieldManager": self._manager},
            body={"metadata": {"resourceVersion": version}, "status": {"devices": devices}},
            content_type=MERGE_PATCH,
        )

    def _replace(
        self, pending: _Pending, claim: Mapping[str, Any], devices: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """The claim as just read, with ``status.devices`` replaced: its allocation goes back
        in this client's serialisation (JSON with ", " and ": "), which is the stored one for
        claims whose opaque configs a client that writes JSON so created."""
        body = copy.deepcopy(dict(claim))
        body.setdefault("status", {})["devices"] = devices
        return self._api.request(
            "PUT",
            claim_path(pending.namespace, pending.name, "status"),
            query={"fieldManager": self._manager},
            body=body,
        )

    def _still_allocated(self, pending: _Pending, claim: Mapping[str, Any]) -> list[DeviceStatus]:
        """The wanted entries whose device (and share) the claim has allocated now: the
        server refuses an entry of any other device."""
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        allocated = {
            (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID") or "")
            for r in results
        }
        kept = [
            d
            for d in pending.devices
            if (DRIVER_NAME, d.pool, d.device, d.share_id or "") in allocated
        ]
        if len(kept) != len(pending.devices):
            log.info(
                "claim %s/%s status: %d entries left out (their devices are no longer "
                "allocated to the claim)",
                pending.namespace,
                pending.name,
                len(pending.devices) - len(kept),
                extra=claim_fields(pending.namespace, pending.name, pending.uid),
            )
        return kept

    def _settled(self, pending: _Pending, claim: Mapping[str, Any]) -> None:
        if pending.devices:
            self._objects.remember(claim)
        else:
            self._objects.forget(pending.uid)  # unprepared: nothing more to write for it

    def _ours(self, entry: Mapping[str, Any]) -> bool:
        return entry.get("driver") == DRIVER_NAME and entry.get("pool") == self._node

    def _entries(self, devices: Sequence[DeviceStatus]) -> list[dict[str, Any]]:
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        entries = []
        for d in devices:
            entry: dict[str, Any] = {
                "driver": DRIVER_NAME,
                "pool": d.pool,
                "device": d.device,
                "conditions": [
                    {
                        "type": c.type,
                        "status": c.status,
                        "reason": c.reason,
                        "message": c.message,
                        "lastTransitionTime": now,
                    }
                    for c in d.conditions
                ],
                "data": dict(d.data),
            }
            if d.share_id:
                entry["shareID"] = d.share_id
            entries.append(entry)
        return entries


def _allocation_refused(err: ApiError) -> bool:
    """The server took the write for a change of status.allocation (which a driver may not
    make): the write's form, not its content, is what it refused."""
    return "status.allocation" in err.message


def _comparable(entry: Mapping[str, Any]) -> str:
    """An entry without its timestamps: what decides whether a write would change anything."""
    conditions = [
        [c.get("type"), c.get("status"), c.get("reason"), c.get("message")]
        for c in entry.get("conditions") or []
    ]
    fields = [entry.get(k) for k in ("driver", "pool", "device", "shareID")]
    return json.dumps([fields, entry.get("data") or {}, conditions], sort_keys=True)


def _same_entries(
    current: Sequence[Mapping[str, Any]], wanted: Sequence[Mapping[str, Any]]
) -> bool:
    return sorted(map(_comparable, current)) == sorted(map(_comparable, wanted))
