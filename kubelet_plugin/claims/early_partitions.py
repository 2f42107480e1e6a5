"""On-demand MIG partitions created before the pod is bound (binding conditions, KEP-5007).

With binding conditions the scheduler allocates a partition, reserves the claim for the pod
and then waits (PreBind) until the device's ``PartitionReady`` condition is true, or sends the
pod back to be scheduled again when ``PartitionFailed`` is. Here each step of a claim is
crash-safe, as prepare's are, in the same checkpoint:

    no record -> PrepareStarted/early=Creating (recorded before anything is made)
              -> the partitions are created (prepare's own code: create_partition)
              -> PrepareStarted/early=Ready (with their UUIDs) -> PartitionReady is set;
    on a failure: what was made is destroyed, the record removed -> PartitionFailed is set.

Prepare later finds the Ready record and takes the partitions over (preparer._takeover), so
nothing is created twice. A claim deallocated or deleted before that has its partitions
destroyed (``release``/``sweep``). After a SIGKILL, start-up reconcile rolls a Creating record
back and keeps a Ready one, whose claim the next sweep checks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.log_format import claim_fields
from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
)
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointWriteError
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    ClaimRecord,
    ClaimState,
    CreatedResources,
    EarlyStage,
)
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.claim_status import Condition, DeviceStatus
from flexgpu.kubelet_plugin.claims.prepare_checks import ClaimConflictError, check_conflicts
from flexgpu.kubelet_plugin.claims.prepare_lock import gpu_key
from flexgpu.kubelet_plugin.claims.prepare_records import (
    device_records,
    intended_partitions,
    one_per_device,
    partition_ready,
    with_ids,
)
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What became of a claim's partitions: the status entries to write and, on a failure,
    the GPUs where creating one failed (GPU index -> why)."""

    statuses: tuple[DeviceStatus, ...]
    failed_gpus: Mapping[int, str] = field(default_factory=dict)
    failed: bool = False
    # Not tried yet: a device is still prepared for another claim (its unprepare comes).
    busy: bool = False


BUSY = Outcome((), busy=True)


class EarlyPartitions:
    def __init__(self, preparer: ClaimPreparerImpl) -> None:
        self._preparer = preparer
        self._node = preparer.node_name

    # -- what a claim waits for ------------------------------------------------------------
    def waiting(self, claim: ClaimView) -> list[AllocatedDevice]:
        """The claim's on-demand MIG devices of this node that carry our binding condition."""
        devices = self._preparer.devices
        return [
            d
            for d in claim.devices
            if d.driver == DRIVER_NAME
            and d.pool == self._node
            and PARTITION_READY_CONDITION in d.binding_conditions
            and devices.partition(d.device) is not None
        ]

    def early_records(self) -> dict[str, ClaimRecord]:
        """Claim UID -> record, of every claim whose partitions were made before binding
        and not yet taken over by prepare."""
        records = self._preparer.load_checkpoint().claims.values()
        return {r.uid: r for r in records if r.early is not None}

    # -- transitions -----------------------------------------------------------------------
    def create(self, claim: ClaimView) -> Outcome | None:
        """Creates the claim's waiting partitions; None when there is nothing to do (none
        waits here, or a record exists: made already, or prepare has the claim)."""
        ours = self.waiting(claim)
        if not ours:
            return None
        preparer = self._preparer
        store, lock = preparer.store, preparer.lock
        keys = {
            gpu_key(p.parent_index) for d in ours if (p := preparer.devices.partition(d.device))
        }
        # The node lock shared, as prepare holds it: start-up reconcile holds it exclusive.
        with lock.operation(), lock.claim(claim.uid), lock.resources(keys):
            if store.get(claim.uid) is not None:
                return None
            others = [r for r in store.checkpoint().claims.values() if r.uid != claim.uid]
            try:
                check_conflicts(others, ours, claim.namespace)
            except ClaimConflictError as err:
                # The scheduler freed the device before the kubelet unprepared it: wait.
                log.info("claim %s/%s waits: %s", claim.namespace, claim.name, err)
                return BUSY
            record = ClaimRecord(
                uid=claim.uid,
                namespace=claim.namespace,
                name=claim.name,
                state=ClaimState.PREPARE_STARTED,
                early=EarlyStage.CREATING,
                # No metadata yet: prepare writes it, and the record it replaces this with.
                devices=device_records(claim, ours, metadata=()),
                created=CreatedResources(
                    mig_instances=intended_partitions(preparer.devices, self._node, claim)
                ),
            )
            try:
                store.put(record)
            except CheckpointWriteError as err:
                return self._failed(claim, ours, None, str(err))
            preparer.step("early-recorded", claim.uid)
            made = []
            current: AllocatedDevice | None = None
            try:
                for current in one_per_device(ours):
                    made.append(preparer.create_partition(current))
                    preparer.step("early-created", claim.uid)
                ready = record.model_copy(
                    update={"early": EarlyStage.READY, "created": with_ids(record.created, made)}
                )
                store.put(ready)
            except Exception as err:
                # Half-made: destroy what exists (found by placement when no UUID is known).
                preparer.undo(record, others)
                store.delete(record.uid)
                return self._failed(claim, ours, current, str(err))
            preparer.step("early-ready", claim.uid)
        log.info(
            "created %s for claim %s/%s before binding",
            ", ".join(d.device for d in ours),
            claim.namespace,
            claim.name,
            extra=claim_fields(claim.namespace, claim.name, claim.uid),
        )
        return Outcome(self.ready_statuses(claim, ready))

    def ready_statuses(self, claim: ClaimView, record: ClaimRecord) -> tuple[DeviceStatus, ...]:
        """PartitionReady for each waiting device, naming the MIG device made for it."""
        by_place = {
            (m.parent_index, m.placement_start): m.uuid for m in record.created.mig_instances
        }
        out = []
        for d in self.waiting(claim):
            part = self._preparer.devices.partition(d.device)
            uuid = by_place.get((part.parent_index, part.placement.start)) if part else None
            data = {"uuid": uuid} if uuid else {}
            out.append(
                DeviceStatus(d.pool, d.device, d.share_id, data, (partition_ready(uuid or "?"),))
            )
        return tuple(out)

    def _failed(
        self,
        claim: ClaimView,
        ours: list[AllocatedDevice],
        at: AllocatedDevice | None,
        error: str,
    ) -> Outcome:
        devices = self._preparer.devices
        failing = at or ours[0]
        part = devices.partition(failing.device)
        index = part.parent_index if part is not None else -1
        message = f"creating {failing.device} on gpu-{index} of node {self._node} failed: {error}"
        log.warning(
            "claim %s/%s: %s; the scheduler will try elsewhere",
            claim.namespace,
            claim.name,
            message,
            extra=claim_fields(claim.namespace, claim.name, claim.uid),
        )
        condition = Condition(PARTITION_FAILED_CONDITION, "True", "CreateFailed", message[:1024])
        statuses = tuple(DeviceStatus(d.pool, d.device, d.share_id, {}, (condition,)) for d in ours)
        return Outcome(statuses, {index: error} if index >= 0 else {}, failed=True)

    def release(self, uid: str) -> list[str]:
        """Destroys the partitions of a claim that no longer waits for them (deallocated,
        deleted, allocated anew); says what it did. Records prepare owns are left alone."""
        preparer = self._preparer
        store, lock = preparer.store, preparer.lock
        with lock.operation(), lock.claim(uid):
            record = store.get(uid)
            if record is None or record.early is None:
                return []
            with lock.resources(preparer.resource_keys(record)):
                record = store.get(uid)
                if record is None or record.early is None:
                    return []
                done = preparer.undo(record, store.checkpoint().claims.values())
                store.delete(uid)
        log.info(
            "claim %s/%s no longer waits for its partitions: %s",
            record.namespace,
            record.name,
            "; ".join(done) or "nothing was left",
            extra=claim_fields(record.namespace, record.name, record.uid),
        )
        return done

    def sweep(self, claims: Mapping[str, ClaimView]) -> list[str]:
        """Releases every early record whose claim (by UID) is not among ``claims`` (the
        claims allocated with waiting partitions here) or waits for other partitions now.
        Returns the UIDs released."""
        released = []
        for uid, record in self.early_records().items():
            claim = claims.get(uid)
            if claim is None or not self._same_partitions(record, claim):
                self.release(uid)
                released.append(uid)
        return released

    def _same_partitions(self, record: ClaimRecord, claim: ClaimView) -> bool:
        wanted = intended_partitions(self._preparer.devices, self._node, claim)
        have = {(m.parent_index, m.placement_start) for m in record.created.mig_instances}
        return have == {(m.parent_index, m.placement_start) for m in wanted}
