"""Prepare / unprepare of claims on this node: the crash-safe state machine.

Per claim: record ``PrepareStarted`` (with everything about to be created or changed: CDI
spec, device metadata files, MPS daemon use, time-slice) -> do it -> record ``Prepared``. A
SIGKILL between any two steps leaves a record that says what may exist, so a retry or the
next start can finish or roll back. Unprepare works from the checkpoint alone: the claim
object may already be gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexgpu.driver.cdi import (
    CdiDevice,
    ClaimIdentity,
    MetadataMount,
    spec_file_name,
)
from flexgpu.driver.claim_results import AllocatedDevice, ClaimResultError
from flexgpu.driver.gpu_model import MigDevice
from flexgpu.driver.log_format import claim_fields
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore, CheckpointWriteError
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    Checkpoint,
    ClaimRecord,
    ClaimState,
    EarlyStage,
    MigInstanceRecord,
)
from flexgpu.kubelet_plugin.claims.claim_source import ClaimSource, ClaimView
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.claim_undo import ClaimUndo
from flexgpu.kubelet_plugin.claims.holder_wait import HolderWait
from flexgpu.kubelet_plugin.claims.metadata_files import FOLDER as METADATA_FOLDER
from flexgpu.kubelet_plugin.claims.metadata_files import MetadataFiles
from flexgpu.kubelet_plugin.claims.mps_daemons import BackendMpsDaemons, MpsDaemons
from flexgpu.kubelet_plugin.claims.prepare_checks import ClaimConflictError, admit
from flexgpu.kubelet_plugin.claims.prepare_errors import HeldError, PrepareError
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock, gpu_key
from flexgpu.kubelet_plugin.claims.prepare_records import (
    device_records,
    device_status,
    intended_partitions,
    intended_resources,
    one_per_device,
    prepared_devices,
    with_ids,
)
from flexgpu.kubelet_plugin.claims.sharing import SharingError, SharingPlan
from flexgpu.kubelet_plugin.claims.sharing_setup import SharingSetupError, apply_sharing
from flexgpu.kubelet_plugin.claims.spec_file import write_claim_spec
from flexgpu.kubelet_plugin.claims.tenancy import ONE_NAMESPACE, SharedGpuTenants, TenantMixError
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.fault_injection import crash_if_at
from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class ClaimPreparerImpl:
    """Implements the gRPC service's DraDriver. Safe to call from many threads: claims on
    different GPUs are prepared in parallel, work on one GPU is serial (see PrepareLock)."""

    def __init__(
        self,
        *,
        node_name: str,
        claims: ClaimSource,
        devices: NodeDevices,
        store: CheckpointStore,
        lock: PrepareLock,
        cdi_dir: Path,
        crash_at: str | None = None,
        status: ClaimStatusWriter | None = None,
        driver_edits: Mapping[str, Any] | None = None,
        metadata_dir: Path | None = None,
    ) -> None:
        self.node_name = node_name
        # The edits every GPU container needs (driver_edits.py), merged into each claim's spec.
        self.driver_edits = dict(driver_edits or {})
        # Who runs MPS control daemons; main.py may hand them to pods of their own.
        self.mps: MpsDaemons = BackendMpsDaemons(devices.backend)
        # Whether claims of different namespaces may share a GPU (tenancy.py).
        self.shared_gpu_tenants: SharedGpuTenants = ONE_NAMESPACE
        self._status = status
        # Called after claims were unprepared (a GPU may have become free to reconfigure).
        self.on_unprepared: Callable[[], None] | None = None
        # Called as (step, claim uid) at each named step; tests use it to force interleavings.
        self.on_step: Callable[[str, str], None] | None = None
        # Fault injection for crash tests (fault_injection.py): SIGKILL ourselves at this
        # named step, exactly as an OOM kill or node shutdown would interrupt us.
        self._crash_at = crash_at
        self._claims = claims
        self.devices = devices
        self._store = store
        self._lock = lock
        self.cdi_dir = cdi_dir
        # Device metadata files (KEP-5304), beside the checkpoint unless main.py says where.
        self.metadata = MetadataFiles(metadata_dir or store.claims_dir.parent / METADATA_FOLDER)
        self._undo = ClaimUndo(devices, lambda: self.mps, self._step, self.metadata)
        # Holders on their way out are waited for, briefly (holder_wait.py).
        self.holders = HolderWait(lambda uid: self._store.get(uid) is not None)

    # -- DraDriver -------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        deadline = self.holders.deadline()
        with self._operation():
            for ref in claims:
                try:
                    with self._lock.claim(ref.uid):
                        devices = self._prepare_waiting(ref, deadline)
                    results[ref.uid] = PrepareResult(devices=devices)
                except PrepareError as err:
                    results[ref.uid] = PrepareResult.failed(str(err))
                except Exception as err:  # API, disk or GPU trouble: that claim fails
                    log.exception(
                        "preparing claim %s/%s failed",
                        ref.namespace,
                        ref.name,
                        extra=claim_fields(ref.namespace, ref.name, ref.uid),
                    )
                    results[ref.uid] = PrepareResult.failed(
                        f"preparing claim {ref.namespace}/{ref.name}: {err}"
                    )
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        results: dict[str, UnprepareResult] = {}
        with self._operation():
            for ref in claims:
                try:
                    with self._lock.claim(ref.uid):
                        record = self._unprepare_one(ref)
                        # Under the claim lock: a later prepare's status comes after this.
                        if record is not None and self._status is not None:
                            self._status.unprepared(record.namespace, record.name, record.uid)
                    results[ref.uid] = UnprepareResult()
                except Exception as err:
                    log.exception(
                        "unpreparing claim %s/%s failed",
                        ref.namespace,
                        ref.name,
                        extra=claim_fields(ref.namespace, ref.name, ref.uid),
                    )
                    results[ref.uid] = UnprepareResult(
                        error=f"unpreparing claim {ref.namespace}/{ref.name}: {err}"
                    )
        if self.on_unprepared is not None and claims:
            self.on_unprepared()
        return results

    # -- state ---------------------------------------------------------------------------
    @property
    def store(self) -> CheckpointStore:
        return self._store

    @property
    def lock(self) -> PrepareLock:
        return self._lock

    def step(self, step: str, uid: str) -> None:
        """A named step (tests force interleavings there; crash tests SIGKILL there)."""
        self._step(step, uid)

    def load_checkpoint(self) -> Checkpoint:
        """Every claim record of this boot; start-up reconcile has already dealt with stale
        or corrupt files."""
        return self._store.checkpoint()

    def spec_path(self, claim_uid: str) -> Path:
        return Path(self._spec_file(claim_uid))

    def _spec_file(self, claim_uid: str) -> str:
        # A string join: this runs on every prepare, where pathlib costs more than it does.
        return f"{os.fspath(self.cdi_dir)}/{spec_file_name(claim_uid)}"

    def _operation(self) -> contextlib.AbstractContextManager[None]:
        """The node lock, shared. A plugin of schema version 1 still running beside us (a
        rolling update) may have written its single-file checkpoint: its records are migrated
        first, under the exclusive lock, so that no claim goes unseen."""
        if self._store.legacy_changed():
            with self._lock:
                scan = self._store.scan()
                if scan.legacy_status == "current":
                    for err in self._store.migrate_legacy(scan.legacy):
                        log.error("migrating the version-1 checkpoint: %s", err)
        return self._lock.operation()

    def resource_keys(self, record: ClaimRecord) -> set[str]:
        """The GPUs a record's claim holds or changed: what its undo must lock."""
        indices: set[int] = set()
        for device in record.devices:
            gpu = self.devices.gpu(device.device_name)
            if gpu is not None:
                indices.add(gpu.index)
        indices.update(int(i) for i in record.created.time_slices)
        indices.update(
            m.parent_index for m in record.created.mig_instances if m.parent_index is not None
        )
        share = record.created.mps_share
        if share is not None and share.gpu_index is not None:
            indices.add(share.gpu_index)
        return {gpu_key(i) for i in indices}

    def _keys_of(self, ours: Sequence[AllocatedDevice]) -> set[str]:
        keys = set()
        for allocated in ours:
            gpu = self.devices.gpu(allocated.device)
            if gpu is not None:
                keys.add(gpu_key(gpu.index))
        return keys

    def _put(self, record: ClaimRecord) -> None:
        try:
            self._store.put(record)
        except CheckpointWriteError as err:
            log.error("%s", err)
            raise PrepareError(f"claim {record.namespace}/{record.name}: {err}") from None

    # -- unprepare one claim -------------------------------------------------------------
    def _unprepare_one(self, ref: ClaimRef) -> ClaimRecord | None:
        record = self._store.get(ref.uid)
        if record is None:
            return None  # unknown claim: nothing to undo
        keys = self.resource_keys(record)
        with self._lock.resources(keys):
            # Another plugin process may have changed it while we waited for the locks.
            record = self._store.get(ref.uid)
            if record is None:
                return None
            if not self.resource_keys(record) <= keys:
                raise PrepareError(f"claim {ref.namespace}/{ref.name} changed meanwhile; retry")
            self._step("unprepare-locked", ref.uid)
            self.undo(record, self._store.checkpoint().claims.values())
            self._store.delete(ref.uid)
        return record

    # -- prepare one claim ---------------------------------------------------------------
    def _prepare_waiting(self, ref: ClaimRef, deadline: float) -> tuple[PreparedDevice, ...]:
        """Prepares the claim; while its devices are held by claims that may be on their way
        out, waits (without the GPU locks) for one to be unprepared and tries again."""
        while True:
            try:
                return self._prepare_one(ref)
            except HeldError as err:
                if not self.holders.until_one_leaves(err.holders, deadline):
                    log.info(
                        "claim %s/%s refused: its devices are held by claims %s",
                        ref.namespace,
                        ref.name,
                        ", ".join(self._named(uid) for uid in err.holders),
                        extra=claim_fields(ref.namespace, ref.name, ref.uid),
                    )
                    raise
                log.info(
                    "claim %s/%s: a claim holding its devices was unprepared; trying again",
                    ref.namespace,
                    ref.name,
                    extra=claim_fields(ref.namespace, ref.name, ref.uid),
                )

    def _named(self, uid: str) -> str:
        record = self._store.get(uid)
        return f"{record.namespace}/{record.name} ({uid})" if record else uid

    def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        existing = self._store.get(ref.uid)
        if existing is not None and existing.state == ClaimState.PREPARED:
            return prepared_devices(existing)  # idempotent repeat
        try:
            claim = self._claims.get(ref.namespace, ref.name)
        except ClaimResultError as err:
            # Bad data in the claim, not trouble reaching it: a plain error, no traceback.
            raise PrepareError(f"claim {ref.namespace}/{ref.name}: {err}") from None
        if claim is None:
            raise PrepareError(f"claim {ref.namespace}/{ref.name} not found")
        if claim.uid != ref.uid:
            raise PrepareError(
                f"claim {ref.namespace}/{ref.name} has UID {claim.uid}, not {ref.uid}: "
                "it was deleted and re-created"
            )
        if not claim.allocated:
            raise PrepareError(f"claim {ref.namespace}/{ref.name} is not allocated")
        ours = [d for d in claim.devices if d.driver == DRIVER_NAME and d.pool == self.node_name]
        for d in ours:
            self._check_known(d)
        keys = self._keys_of(ours) | (self.resource_keys(existing) if existing else set())
        with self._lock.resources(keys):
            # Re-read under the locks: another plugin process (rolling update) may have
            # prepared it, or half-prepared it, while we waited.
            existing = self._store.get(ref.uid)
            if existing is not None and existing.state == ClaimState.PREPARED:
                return prepared_devices(existing)
            if existing is not None and not self.resource_keys(existing) <= keys:
                raise PrepareError(f"claim {ref.namespace}/{ref.name} changed meanwhile; retry")
            self._step("prepare-locked", claim.uid)
            # Records of claims on our GPUs cannot change while we hold their locks.
            others = [r for r in self._store.checkpoint().claims.values() if r.uid != claim.uid]
            try:
                plan = admit(claim, ours, others, self.devices, self.shared_gpu_tenants)
            except TenantMixError as err:
                message = f"claim {ref.namespace}/{ref.name}: {err}"
                raise HeldError(message, err.holders) from None
            except ClaimConflictError as err:
                raise HeldError(str(err), err.holders) from None
            except SharingError as err:
                raise PrepareError(str(err)) from None
            ready = self._takeover(existing, claim)
            if existing is not None and ready is None:
                # A half-done earlier attempt (plugin killed mid-way): undo it, start over.
                self.undo(existing, others)
                self._store.delete(existing.uid)
            prepared, cdi_devices = self._carry_out(claim, ours, plan, others, ready or {})
        if self._status is not None:
            share = prepared.created.mps_share
            status = device_status(
                self.devices, ours, cdi_devices, plan, share, namespace=claim.namespace
            )
            self._status.prepared(claim.namespace, claim.name, claim.uid, status)
        log.info(
            "prepared claim %s/%s: %s",
            claim.namespace,
            claim.name,
            ", ".join(d.device for d in ours) or "no devices of this node",
            extra=claim_fields(claim.namespace, claim.name, claim.uid),
        )
        return prepared_devices(prepared)

    def _carry_out(
        self,
        claim: ClaimView,
        ours: Sequence[AllocatedDevice],
        plan: SharingPlan,
        others: Sequence[ClaimRecord],
        ready: Mapping[tuple[int, int], MigDevice],
    ) -> tuple[ClaimRecord, list[CdiDevice]]:
        """Record PrepareStarted, create and change what the plan says, write the CDI spec,
        record Prepared. On any failure everything is taken back and the record removed.
        ``ready``: partitions created before the pod was bound, (GPU, placement) -> instance;
        the new record names them, replacing the early one in a single write."""
        intended = intended_resources(
            self.devices,
            self.node_name,
            self._spec_file(claim.uid),
            claim,
            plan,
            metadata_dir=self.metadata.claim_dir(claim.uid) if ours else None,
        )
        record = ClaimRecord(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=ClaimState.PREPARE_STARTED,
            devices=device_records(claim, ours),
            created=with_ids(intended, list(ready.values())),
        )
        self._put(record)
        self._step("after-prepare-started", claim.uid)
        try:
            materialised = [self._materialise(d, ready) for d in one_per_device(ours)]
            self._step("after-devices-created", claim.uid)
            try:
                cdi_devices, mig_share = apply_sharing(
                    self.devices,
                    node_name=self.node_name,
                    mps=self.mps,
                    claim=claim,
                    plan=plan,
                    devices=[cdi for cdi, _ in materialised],
                )
            except SharingSetupError as err:
                raise PrepareError(str(err)) from None
            self._step("after-mps-started", claim.uid)
            # The files before the spec that mounts them: a spec never names a missing file.
            mounts = self.metadata.write(self.devices, claim, ours, cdi_devices) if ours else []
            self._step("after-metadata-written", claim.uid)
            self._write_spec(claim, cdi_devices, mounts)
            self._step("after-cdi-written", claim.uid)
            created = with_ids(record.created, [mig for _, mig in materialised if mig])
            if mig_share is not None:
                created = created.model_copy(update={"mps_share": mig_share})
            prepared = record.model_copy(update={"state": ClaimState.PREPARED, "created": created})
            self._put(prepared)
        except BaseException:
            # Half-way failure: take back what was done, so nothing is left and a retry
            # starts clean. (Removing the record needs no disk space.)
            self.undo(record, others)
            self._store.delete(record.uid)
            raise
        return prepared, cdi_devices

    def _takeover(
        self, existing: ClaimRecord | None, claim: ClaimView
    ) -> dict[tuple[int, int], MigDevice] | None:
        """The partitions an early record (binding conditions) made ready, by (GPU,
        placement), when they are exactly the ones the claim's allocation needs and still
        exist; else None, and the record is undone like any half-done attempt."""
        if existing is None or existing.early != EarlyStage.READY:
            return None
        wanted = {
            (p.parent_index, p.placement_start)
            for p in intended_partitions(self.devices, self.node_name, claim)
        }
        ready = {}
        for instance in existing.created.mig_instances:
            live = self._live_instance(instance)
            if live is None or instance.parent_index is None:
                return None
            ready[(instance.parent_index, instance.placement_start)] = live
        return ready if set(ready) == wanted else None

    def create_partition(self, allocated: AllocatedDevice) -> MigDevice:
        """Creates the MIG instance of a dynamic-MIG device (prepare, and before binding
        through early_partitions.py). The caller holds the GPU's lock."""
        part = self.devices.partition(allocated.device)
        if part is None:
            raise PrepareError(f"device {allocated.device} is not an on-demand MIG partition")
        # On a dynamic-MIG GPU: MIG mode off for the whole GPU, on for a partition.
        self.devices.ready_for(allocated.device)
        created = self.devices.backend.create_mig_device(
            part.parent_index, part.profile_id, part.placement
        )
        if created.uuid is None:
            raise PrepareError(f"MIG instance for {allocated.device} has no UUID")
        log.info("created %s (%s) for %s", allocated.device, created.uuid, allocated.request)
        return created

    def _materialise(
        self, allocated: AllocatedDevice, ready: Mapping[tuple[int, int], MigDevice]
    ) -> tuple[CdiDevice, MigDevice | None]:
        """The device's CDI content, creating its MIG instance first for dynamic MIG (unless
        it was made ready before binding)."""
        part = self.devices.partition(allocated.device)
        if part is None:
            # On a dynamic-MIG GPU: MIG mode off for the whole GPU.
            self.devices.ready_for(allocated.device)
            device = self._device(allocated)
            return dataclasses.replace(device, share_id=allocated.share_id), None
        created = ready.get((part.parent_index, part.placement.start))
        if created is None:
            created = self.create_partition(allocated)
        parent = self.devices.gpus_by_index().get(part.parent_index)
        minor = parent.minor_number if parent else None
        assert created.uuid is not None  # create_partition refuses an instance without one
        nodes = self.devices.nodes.mig(minor, created.gpu_instance_id, created.compute_instance_id)
        return CdiDevice(allocated.device, created.uuid, nodes, allocated.share_id), created

    def _check_known(self, allocated: AllocatedDevice) -> None:
        if self.devices.partition(allocated.device) is None:
            self._device(allocated)

    def _step(self, step: str, uid: str) -> None:
        if self.on_step is not None:
            self.on_step(step, uid)
        crash_if_at(self._crash_at, step)

    def _device(self, allocated: AllocatedDevice) -> CdiDevice:
        device = self.devices.resolve(allocated.device)
        if device is None:
            raise PrepareError(
                f"device {allocated.device} (request {allocated.request}) is not published by "
                f"node {self.node_name}; the allocation is out of date"
            )
        return device

    def _write_spec(
        self, claim: ClaimView, devices: Sequence[CdiDevice], metadata: Sequence[MetadataMount]
    ) -> None:
        write_claim_spec(
            self._spec_file(claim.uid),
            ClaimIdentity(claim.uid, claim.namespace, claim.name),
            devices,
            driver_edits=self.driver_edits,
            boot_id=self._store.boot_id,
            metadata=metadata,
        )

    def undo(self, record: ClaimRecord, all_records: Iterable[ClaimRecord]) -> list[str]:
        """Removes what the record says was (or may have been) created (claim_undo.py). The
        caller holds the locks of the record's GPUs."""
        return self._undo.undo(record, all_records)

    def _live_instance(self, record: MigInstanceRecord) -> MigDevice | None:
        return self._undo.live_instance(record)
