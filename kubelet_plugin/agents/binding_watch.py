"""Binding conditions (KEP-5007): finds the claims whose partitions on this node wait for
``PartitionReady``, has them created (early_partitions.py) and reports the outcome on the
claim, and taints a GPU where creating one failed so that the pod, sent back by the
scheduler, goes elsewhere; and gives each free shared GPU to the namespace of the first claim
allocated there (``TenantReady``), sending back the claims of other namespaces allocated in
the same instant (``TenantTaken``; tenant_binding.py).

One watch of ResourceClaims, paced like the plugin's other watches. No field selector reaches
into a claim's allocation, so while the controller labels allocated claims with their node
(its Lease says so: api/claim_scope.py) the watch asks for this node's label only, and
otherwise covers the cluster; either way it keeps only claims with a waiting device of this
node's pool. The work runs on one thread of its own: a claim's
partitions are created while the scheduler waits, never on the kubelet's prepare path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flexgpu.driver.claim_results import ClaimResultError
from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
)
from flexgpu.kubelet_plugin.api.claim_scope import ClaimScope
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, path_of
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView, parse_claim
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter, DeviceStatus
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from flexgpu.kubelet_plugin.claims.tenant_binding import TenantBinding
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

log = logging.getLogger(__name__)

CLAIMS = path_of("apis", "resource.k8s.io", "v1", "resourceclaims")
SLICES = path_of("apis", "resource.k8s.io", "v1", "resourceslices")
# Also woken by every change of a kept claim; the tick ends failure taints and retries.
TICK_S = 5.0
# While a claim waits for another claim's unprepare (its device is still prepared).
BUSY_RETRY_S = 0.5
# An outcome written but not yet seen on the watch is written again (built from a fresh read)
# after this long, doubling up to RESEND_MAX_S: a lost write never leaves the scheduler
# waiting, and a refused one is not sent again on every pass.
RESEND_FIRST_S = 5.0
RESEND_MAX_S = 60.0
# After a free shared GPU is given to a namespace (TenantReady), the node's slices are written
# again once this long has passed. Why: while a pod waits in the scheduler's PreBind for a
# binding condition, Kubernetes 1.37's scheduler counts its claim's consumed capacity twice
# (the claim is both allocated in its informer's view and still "in flight"), so for those
# seconds a shared GPU looks fuller than it is and fractions that fit are found
# unschedulable; nothing but a ResourceSlice update (or the scheduler's 5-minute flush)
# retries them. The scheduler checks binding conditions every 5 s: 7 s covers that poll.
REQUEUE_AFTER_S = 7.0


class BindingWatch:
    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        *,
        early: EarlyPartitions,
        status: ClaimStatusWriter,
        devices: NodeDevices,
        republish: Callable[[], None],
        failure_s: float,
        records: Callable[[], Iterable[ClaimRecord]] = tuple,
        tenants_changed: Callable[[], object] = lambda: None,
        requeue: Callable[[], None] = lambda: None,
        step: Callable[[str, str], None] = lambda name, uid: None,
        clock: Callable[[], float] = time.monotonic,
        labels_lease: str = "",
    ) -> None:
        self._node = node_name
        self.tenants = TenantBinding(node_name, devices.shared_gpu_index)
        self._records = records
        self._tenants_changed = tenants_changed
        # Claim UID -> the binding outcomes written for its devices: one claim's write
        # replaces all of this node's entries, so each write carries every outcome.
        self._outcomes: dict[str, dict[tuple[str, str, str], DeviceStatus]] = {}
        # Claim UID -> (when its outcomes are written again if still not seen, the interval).
        self._resend: dict[str, tuple[float, float]] = {}
        self._early = early
        self._status = status
        self._devices = devices
        self._republish = republish
        self._requeue = requeue
        # Named steps, as prepare's (crash tests SIGKILL the plugin there).
        self._step = step
        # When the node's slices are written again for pods found unschedulable meanwhile.
        self._requeue_at: float | None = None
        self._failure_s = failure_s
        self._clock = clock
        self._wake = threading.Event()
        self._busy = False
        self._watching = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # GPU index -> (why creating a partition failed, until when its partitions are tainted)
        self._failures: dict[int, tuple[str, float]] = {}
        # Claim UID -> the devices whose failure was reported: not tried again while the claim
        # keeps that allocation (our own status write may not have come back on the watch).
        self._reported_failed: dict[str, tuple[str, ...]] = {}
        self._api = api
        self.scope = ClaimScope(api, node_name, labels_lease, on_change=self._wake.set, clock=clock)
        self._query: dict[str, str] = {}
        self.claims = self._new_watch()

    def _new_watch(self) -> WatchedObjects:
        return WatchedObjects(
            self._api,
            CLAIMS,
            query=self._query,
            on_change=self._wake.set,
            name="resourceclaims (binding conditions)",
            keep=self.waits_here,
        )

    def waits_here(self, claim: Mapping[str, Any]) -> bool:
        """Whether an allocated claim has a device of this node with our partition binding
        condition, or a shared GPU of this node (whose tenant it waits for or holds): the
        only claims kept (memory: the watch sees every claim of the cluster)."""
        allocation = (claim.get("status") or {}).get("allocation") or {}
        results = (allocation.get("devices") or {}).get("results") or []
        return any(
            r.get("driver") == DRIVER_NAME
            and r.get("pool") == self._node
            and (
                PARTITION_READY_CONDITION in (r.get("bindingConditions") or [])
                or self._devices.shared_gpu_index(str(r.get("device"))) is not None
            )
            for r in results
        )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.ensure_watch()
        self._thread = threading.Thread(target=self._run, name="binding-conditions", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._watching:
            self.claims.stop()
            self.scope.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            wait = BUSY_RETRY_S if self._busy else TICK_S
            if self._requeue_at is not None:
                wait = max(0.0, min(wait, self._requeue_at - self._clock()))
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.ensure_watch()
                self.process()
            except Exception:  # a bad claim or a GPU error never ends the loop
                log.exception("binding conditions: handling claims failed; retrying")

    def ensure_watch(self) -> None:
        """Claims are watched only while the node has on-demand MIG GPUs (or partitions made
        before binding) or shared GPUs with tenant conditions: every node watching every
        claim of the cluster would cost the API server a fan-out of each claim change for
        nothing. Modes change with GpuNodePolicies."""
        wanted = (
            bool(self._devices.dynamic_gpus())
            or bool(self._early.early_records())
            or self._devices.tenant_binding()
        )
        if wanted and not self._watching:
            self.scope.start()
            self._query = self.scope.query()
            self.claims = self._new_watch()
            self.claims.start()
            self._watching = True
            log.info("binding conditions: watching ResourceClaims (%s)", self._scope_text())
        elif wanted and self.scope.query() != self._query:
            # The controller started or stopped labelling claims: the watch follows.
            self.claims.stop()
            self._query = self.scope.query()
            self.claims = self._new_watch()
            self.claims.start()
            log.info("binding conditions: now watching %s", self._scope_text())
        elif not wanted and self._watching:
            self.claims.stop()
            self.scope.stop()
            self._watching = False
            log.info("binding conditions: no on-demand MIG or shared GPU left; claims not watched")

    def _scope_text(self) -> str:
        selector = self._query.get("labelSelector")
        return f"those labelled {selector}" if selector else "every claim of the cluster"

    # -- the work --------------------------------------------------------------------------
    def process(self) -> None:
        """One pass over the kept claims: partitions of claims that no longer wait are
        destroyed, waiting ones are created (or their outcome written again), expired
        failure taints are lifted."""
        if not self._watching or not self.claims.synced:
            return  # an early record's claim may just not be listed yet
        claims: dict[str, ClaimView] = {}
        told: dict[str, set[str]] = {}
        order: list[tuple[str, str, ClaimView]] = []
        for obj in self.claims.items():
            try:
                view = parse_claim(obj)
            except ClaimResultError as err:
                meta = obj.get("metadata") or {}
                log.warning("claim %s/%s: %s", meta.get("namespace"), meta.get("name"), err)
                continue
            claims[view.uid] = view
            told[view.uid] = self._true_conditions(obj)
            allocated = ((obj.get("status") or {}).get("allocation") or {}).get(
                "allocationTimestamp"
            )
            order.append((str(allocated or ""), f"{view.namespace}/{view.name}", view))
        # Outcomes of claims that left, and of devices a claim no longer has allocated (sent
        # back and allocated anew), are dropped: never written again.
        self._outcomes = {
            uid: {key: o for key, o in outcomes.items() if key in _keys(claims[uid])}
            for uid, outcomes in self._outcomes.items()
            if uid in claims
        }
        sent_back = self._decide_tenants([view for *_, view in sorted(order)], told)
        self._early.sweep(claims)
        self._reported_failed = {
            uid: devices
            for uid, devices in self._reported_failed.items()
            if uid in claims and devices == _devices(claims[uid])
        }
        records = self._early.early_records()
        self._busy = False
        for uid, claim in claims.items():
            if uid in records:
                # Made, but the status may not have gone out (a crash, an API error).
                if PARTITION_READY_CONDITION not in told[uid] and uid not in self._outcomes:
                    self._write(claim, self._early.ready_statuses(claim, records[uid]))
                continue
            decided = told[uid] & {PARTITION_READY_CONDITION, PARTITION_FAILED_CONDITION}
            if decided or uid in self._reported_failed or uid in sent_back:
                continue  # decided: prepare (or the scheduler) takes it from here
            if not self._early.waiting(claim):
                continue  # a claim kept for its shared GPU only
            outcome = self._early.create(claim)
            if outcome is None:
                continue
            if outcome.busy:
                self._busy = True
                continue
            self._write(claim, outcome.statuses)
            if outcome.failed:
                self._reported_failed[uid] = _devices(claim)
            if outcome.failed_gpus:
                until = self._clock() + self._failure_s
                for index, why in outcome.failed_gpus.items():
                    self._failures[index] = (why, until)
                self._taint()
        self._resend_unseen(claims, told)
        self._expire()
        self._requeue_due()

    def _requeue_due(self) -> None:
        if self._requeue_at is None or self._clock() < self._requeue_at:
            return
        self._requeue_at = None
        log.info(
            "shared GPUs given to namespaces: the node's slices are written again so that the "
            "scheduler retries fractions it found unschedulable while those pods waited"
        )
        self._requeue()

    def _resend_unseen(self, claims: Mapping[str, ClaimView], told: Mapping[str, set[str]]) -> None:
        """Writes again, paced, the outcomes not yet seen on the watch whose write is no
        longer queued: lost (the writer gave up, the plugin restarted before it went out) or
        refused. The writer builds each write from the claim as the server has it now."""
        now = self._clock()
        self._resend = {uid: r for uid, r in self._resend.items() if uid in self._outcomes}
        for uid, outcomes in self._outcomes.items():
            claim = claims.get(uid)
            if claim is None or not outcomes:
                continue
            wanted = {c.type for o in outcomes.values() for c in o.conditions if c.status == "True"}
            if wanted <= told.get(uid, set()) or self._status.is_pending(uid):
                continue
            due, interval = self._resend.get(uid, (now + RESEND_FIRST_S, RESEND_FIRST_S))
            if now < due:
                self._resend.setdefault(uid, (due, interval))
                continue
            refusal = self._status.refusal(uid)
            log.warning(
                "claim %s/%s: binding outcome %s not seen on the claim after %.0f s%s; "
                "writing it again",
                claim.namespace,
                claim.name,
                ", ".join(sorted(wanted)),
                interval,
                f" (refused: {refusal})" if refusal else "",
            )
            self._status.binding(claim.namespace, claim.name, uid, tuple(outcomes.values()))
            interval = min(interval * 2, RESEND_MAX_S)
            self._resend[uid] = (now + interval, interval)

    def _decide_tenants(
        self, claims: Sequence[ClaimView], told: Mapping[str, set[str]]
    ) -> set[str]:
        """Gives free shared GPUs to the first namespace allocated there and sends other
        namespaces' claims back; the UIDs of the claims sent back (in this pass or before).
        The new tenants go to the slice publisher (``tenants_changed``) before any outcome
        is written, so the GPU's tenant is on its way when the scheduler reads TenantTaken."""
        if not self._devices.tenant_binding():
            return set()
        before = self.tenants.holders()
        decisions = self.tenants.decide(claims, told, self._records)
        if decisions or self.tenants.holders() != before:
            self._tenants_changed()  # reads the records again: only when holders changed
        for decision in decisions:
            claim = decision.claim
            # Decided, not yet written: a restart decides again from the claims and records.
            self._step("tenant-decided", claim.uid)
            log.info(
                "claim %s/%s: shared GPU %s",
                claim.namespace,
                claim.name,
                "taken by another namespace; sent back to the scheduler"
                if decision.taken
                else f"serves namespace {claim.namespace}",
            )
            self._write(claim, decision.statuses)
            if not decision.taken:
                # Its pod leaves PreBind within the scheduler's next poll; then (see
                # REQUEUE_AFTER_S) the pods found unschedulable meanwhile are retried.
                due = self._clock() + REQUEUE_AFTER_S
                self._requeue_at = max(self._requeue_at or due, due)
        return {c.uid for c in claims if self.tenants.sent_back(c.uid)}

    def _write(self, claim: ClaimView, statuses: Sequence[DeviceStatus]) -> None:
        """Writes the claim's outcomes: these, and the earlier ones of devices it still has
        allocated (a claim sent back and allocated anew keeps none of its first devices)."""
        allocated = _keys(claim)
        outcomes = {
            key: status
            for key, status in self._outcomes.get(claim.uid, {}).items()
            if key in allocated
        }
        for status in statuses:
            outcomes[(status.pool, status.device, status.share_id or "")] = status
        self._outcomes[claim.uid] = outcomes
        self._resend.pop(claim.uid, None)
        self._status.binding(claim.namespace, claim.name, claim.uid, tuple(outcomes.values()))

    def _true_conditions(self, claim: Mapping[str, Any]) -> set[str]:
        """The condition types true on this node's status entries of the claim."""
        entries = (claim.get("status") or {}).get("devices") or []
        return {
            c.get("type", "")
            for e in entries
            if e.get("driver") == DRIVER_NAME and e.get("pool") == self._node
            for c in e.get("conditions") or []
            if c.get("status") == "True"
        }

    def _expire(self) -> None:
        now = self._clock()
        expired = [i for i, (_, until) in self._failures.items() if until <= now]
        for index in expired:
            del self._failures[index]
            log.info("GPU %d: partitions offered again after the failure cool-down", index)
        if expired:
            self._taint()

    def _taint(self) -> None:
        self._devices.set_partition_failures({i: why for i, (why, _) in self._failures.items()})
        self._devices.refresh()
        self._republish()

    def failures(self) -> dict[int, str]:
        """GPU index -> why its partitions are tainted now."""
        return {i: why for i, (why, _) in self._failures.items()}


def _keys(claim: ClaimView) -> set[tuple[str, str, str]]:
    """(pool, device, share ID) of each device the claim has allocated now."""
    return {(d.pool, d.device, d.share_id or "") for d in claim.devices}


def _devices(claim: ClaimView) -> tuple[str, ...]:
    return tuple(sorted(f"{d.pool}/{d.device}" for d in claim.devices))


def server_keeps_binding_conditions(api: KubeApi, node_name: str) -> bool:
    """Whether the API server stores a device's binding conditions: a dry-run create of a
    slice that has them (nothing is written). A server with the feature off drops the fields,
    and the plugin would keep rewriting slices it can never match."""
    probe = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node_name}-{DRIVER_NAME}-binding-probe"},
        "spec": {
            "driver": DRIVER_NAME,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": 0, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "probe",
                    "bindingConditions": [PARTITION_READY_CONDITION],
                    "bindingFailureConditions": [PARTITION_FAILED_CONDITION],
                    "bindsToNode": True,
                }
            ],
        },
    }
    try:
        created = api.request("POST", SLICES, query={"dryRun": "All"}, body=probe)
    except (ApiError, OSError, TimeoutError) as err:
        log.warning("binding conditions: the probe slice was refused (%s); off", err)
        return False
    devices = (created.get("spec") or {}).get("devices") or [{}]
    return bool(devices[0].get("bindingConditions"))
