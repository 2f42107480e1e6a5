"""Prepare / unprepare of claims on this node: the crash-safe state machine.

Per claim: record ``PrepareStarted`` (with everything about to be created or changed: CDI
spec, MPS daemon use, time-slice) -> do it -> record ``Prepared``. A SIGKILL between any two
steps leaves a record that says what may exist, so a retry or the next start can finish or
roll back. Unprepare works from the checkpoint alone: the claim object may already be gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from driver.atomic_file import atomic_write_bytes
from driver.backend_errors import GpuLostError, NotFoundError
from driver.cdi import (
    CdiDevice,
    ClaimIdentity,
    cdi_device_id,
    encode_spec,
    host_device_nodes,
    render_claim_spec,
    spec_file_name,
)
from driver.gpu_model import TimeSliceInterval
from driver.names import DRIVER_NAME
from driver.quantity import QuantityError, parse_quantity
from kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    CreatedResources,
    DeviceRecord,
    MigInstanceRecord,
    MpsShareRecord,
)
from kubelet_plugin.claim_source import AllocatedDevice, ClaimSource, ClaimView
from kubelet_plugin.claim_status import ClaimStatusWriter, DeviceStatus
from kubelet_plugin.claims import ClaimRef, PreparedDevice, PrepareResult, UnprepareResult
from kubelet_plugin.node_devices import NodeDevices
from kubelet_plugin.prepare_lock import PrepareLock
from kubelet_plugin.sharing import (
    SharingError,
    SharingPlan,
    mps_env,
    mps_mounts,
    plan_sharing,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
ENV_TIME_SLICE = "FLEXGPU_TIME_SLICE"


class PrepareError(Exception):
    """A claim cannot be prepared; the message goes to the kubelet (and the pod's events)."""


class ClaimPreparerImpl:
    """Implements the gRPC service's ClaimPreparer."""

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
    ) -> None:
        self.node_name = node_name
        self._status = status
        # Called after claims were unprepared (a GPU may have become free to reconfigure).
        self.on_unprepared: Callable[[], None] | None = None
        # Fault injection for crash tests (FLEXGPU_FAULT_CRASH_AT): SIGKILL ourselves at a
        # named step, exactly as an OOM kill or node shutdown would interrupt us.
        self._crash_at = crash_at
        self._claims = claims
        self.devices = devices
        self._store = store
        self._lock = lock
        self.cdi_dir = cdi_dir

    # -- ClaimPreparer -------------------------------------------------------------------
    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        with self._lock:
            # Re-read under the lock: another plugin instance (rolling update) may have
            # written since we last looked.
            checkpoint = self.load_checkpoint()
            for ref in claims:
                try:
                    checkpoint, devices = self._prepare_one(checkpoint, ref)
                    results[ref.uid] = PrepareResult(devices=devices)
                except PrepareError as err:
                    results[ref.uid] = PrepareResult.failed(str(err))
                except Exception as err:  # API, disk or GPU trouble: that claim fails
                    log.exception("preparing claim %s/%s failed", ref.namespace, ref.name)
                    results[ref.uid] = PrepareResult.failed(
                        f"preparing claim {ref.namespace}/{ref.name}: {err}"
                    )
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        results: dict[str, UnprepareResult] = {}
        with self._lock:
            checkpoint = self.load_checkpoint()
            for ref in claims:
                record = checkpoint.claims.get(ref.uid)
                if record is None:
                    results[ref.uid] = UnprepareResult()  # unknown claim: nothing to undo
                    continue
                try:
                    self.undo(record, checkpoint.claims.values())
                    checkpoint = checkpoint.without_claim(ref.uid)
                    self._store.save(checkpoint)
                    if self._status is not None:
                        self._status.unprepared(record.namespace, record.name, record.uid)
                    results[ref.uid] = UnprepareResult()
                except Exception as err:
                    log.exception("unpreparing claim %s/%s failed", ref.namespace, ref.name)
                    results[ref.uid] = UnprepareResult(
                        error=f"unpreparing claim {ref.namespace}/{ref.name}: {err}"
                    )
        if self.on_unprepared is not None and claims:
            self.on_unprepared()
        return results

    # -- state ---------------------------------------------------------------------------
    def load_checkpoint(self) -> Checkpoint:
        """The current checkpoint; start-up reconcile has already dealt with stale or
        corrupt files."""
        return self._store.load().checkpoint

    def spec_path(self, claim_uid: str) -> Path:
        return self.cdi_dir / spec_file_name(claim_uid)

    # -- prepare one claim ---------------------------------------------------------------
    def _prepare_one(
        self, checkpoint: Checkpoint, ref: ClaimRef
    ) -> tuple[Checkpoint, tuple[PreparedDevice, ...]]:
        existing = checkpoint.claims.get(ref.uid)
        if existing is not None and existing.state == ClaimState.PREPARED:
            return checkpoint, _prepared_devices(existing)  # idempotent repeat
        claim = self._claims.get(ref.namespace, ref.name)
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
        others = [r for r in checkpoint.claims.values() if r.uid != claim.uid]
        self._check_conflicts(others, ours)
        self._check_share_capacity(others, ours)
        try:
            plan = plan_sharing(claim, ours, self.devices)
        except SharingError as err:
            raise PrepareError(str(err)) from None
        if existing is not None:
            # A half-done earlier attempt (plugin killed mid-way): undo it, then start over.
            self.undo(existing, others)
            checkpoint = checkpoint.without_claim(existing.uid)
        record = ClaimRecord(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=ClaimState.PREPARE_STARTED,
            devices=device_records(claim, ours),
            created=self._intended(claim, plan),
        )
        checkpoint = checkpoint.with_claim(record)
        self._store.save(checkpoint)
        self._maybe_crash("after-prepare-started")
        try:
            cdi_devices = [self._materialise(d) for d in ours]
            self._maybe_crash("after-devices-created")
            env, mounts = self._apply_sharing(plan)
            self._write_spec(claim, cdi_devices, env, mounts)
        except Exception:
            # Half-way failure: take back what was done, so nothing is left and a retry
            # starts clean.
            self.undo(record, others)
            checkpoint = checkpoint.without_claim(record.uid)
            self._store.save(checkpoint)
            raise
        self._maybe_crash("after-cdi-written")
        checkpoint = checkpoint.with_claim(record.model_copy(update={"state": ClaimState.PREPARED}))
        self._store.save(checkpoint)
        if self._status is not None:
            self._status.prepared(
                claim.namespace, claim.name, claim.uid, self._device_status(ours, cdi_devices, plan)
            )
        log.info(
            "prepared claim %s/%s: %s",
            claim.namespace,
            claim.name,
            ", ".join(d.device for d in ours) or "no devices of this node",
        )
        return checkpoint, _prepared_devices(checkpoint.claims[claim.uid])

    def _intended(self, claim: ClaimView, plan: SharingPlan) -> CreatedResources:
        mps = None
        if plan.mps is not None:
            gpu = self.devices.gpus_by_index().get(plan.mps.gpu_index)
            mps = MpsShareRecord(
                gpu_uuids=[gpu.uuid] if gpu else [],
                gpu_index=plan.mps.gpu_index,
                active_thread_percentage=plan.mps.active_thread_percentage,
                pinned_memory_limits=(
                    {"0": f"{plan.mps.pinned_memory_mib}Mi"}
                    if plan.mps.pinned_memory_mib is not None
                    else {}
                ),
            )
        return CreatedResources(
            cdi_spec_path=str(self.spec_path(claim.uid)),
            mig_instances=self._intended_partitions(claim),
            mps_share=mps,
            time_slices={str(i): str(v) for i, v in plan.time_slices.items()},
        )

    def _device_status(
        self,
        ours: Sequence[AllocatedDevice],
        cdi_devices: Sequence[CdiDevice],
        plan: SharingPlan,
    ) -> list[DeviceStatus]:
        """What the user sees in the claim's status for each device."""
        result = []
        for allocated, cdi in zip(ours, cdi_devices, strict=True):
            gpu = self.devices.gpu(allocated.device)
            data: dict[str, Any] = {"uuid": cdi.uuid}
            if gpu is not None:
                data["productName"] = gpu.product_name
            part = self.devices.partition(allocated.device)
            if part is not None:
                data["migProfile"] = part.profile_name
                data["placement"] = {"start": part.placement.start, "size": part.placement.size}
            if allocated.share_id is not None:
                data["granted"] = dict(allocated.consumed_capacity)
            if plan.mps is not None:
                data["mps"] = {
                    k: v
                    for k, v in (
                        ("activeThreadPercentage", plan.mps.active_thread_percentage),
                        (
                            "pinnedDeviceMemoryLimit",
                            f"{plan.mps.pinned_memory_mib}Mi"
                            if plan.mps.pinned_memory_mib is not None
                            else None,
                        ),
                    )
                    if v is not None
                }
            if plan.time_slices:
                data["timeSlice"] = str(next(iter(plan.time_slices.values())))
            result.append(DeviceStatus(allocated.pool, allocated.device, allocated.share_id, data))
        return result

    def _intended_partitions(self, claim: ClaimView) -> list[MigInstanceRecord]:
        records = []
        for d in claim.devices:
            part = self.devices.partition(d.device) if d.pool == self.node_name else None
            if part is None or d.driver != DRIVER_NAME:
                continue
            parent = self.devices.gpus_by_index().get(part.parent_index)
            records.append(
                MigInstanceRecord(
                    parent_uuid=parent.uuid if parent else "",
                    parent_index=part.parent_index,
                    profile=part.profile_name,
                    profile_id=part.profile_id,
                    placement_start=part.placement.start,
                    placement_size=part.placement.size,
                )
            )
        return records

    def _materialise(self, allocated: AllocatedDevice) -> CdiDevice:
        """The device's CDI content, creating its MIG instance first for dynamic MIG."""
        part = self.devices.partition(allocated.device)
        if part is None:
            return self._device(allocated)
        created = self.devices.backend.create_mig_device(
            part.parent_index, part.profile_id, part.placement
        )
        if created.uuid is None:
            raise PrepareError(f"MIG instance for {allocated.device} has no UUID")
        parent = self.devices.gpus_by_index().get(part.parent_index)
        minor = parent.minor_number if parent else None
        log.info("created %s (%s) for %s", allocated.device, created.uuid, allocated.request)
        return CdiDevice(allocated.device, created.uuid, host_device_nodes(minor))

    def _check_known(self, allocated: AllocatedDevice) -> None:
        if self.devices.partition(allocated.device) is None:
            self._device(allocated)

    def _apply_sharing(self, plan: SharingPlan) -> tuple[dict[str, str], list[tuple[str, str]]]:
        backend = self.devices.backend
        env: dict[str, str] = {}
        for index, interval in plan.time_slices.items():
            backend.set_time_slice(index, interval)
            # Tells the workload, and a rebuild after a lost checkpoint, what was set.
            env[ENV_TIME_SLICE] = str(interval)
        if plan.mps is None:
            return env, []
        daemon = backend.start_mps_daemon(plan.mps.gpu_index)
        return {**env, **mps_env(daemon, plan.mps)}, mps_mounts(daemon)

    def _maybe_crash(self, step: str) -> None:
        if self._crash_at == step:
            log.warning("fault injection: SIGKILL at %s", step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _device(self, allocated: AllocatedDevice) -> CdiDevice:
        device = self.devices.resolve(allocated.device)
        if device is None:
            raise PrepareError(
                f"device {allocated.device} (request {allocated.request}) is not published by "
                f"node {self.node_name}; the allocation is out of date"
            )
        return device

    def _check_conflicts(
        self, others: Iterable[ClaimRecord], ours: Sequence[AllocatedDevice]
    ) -> None:
        exclusive = {d.device for d in ours if not d.admin_access and d.share_id is None}
        for other in others:
            for device in other.devices:
                if (
                    device.device_name in exclusive
                    and device.share_id is None
                    and not device.admin_access
                ):
                    raise PrepareError(
                        f"device {device.device_name} is already prepared for claim "
                        f"{other.namespace}/{other.name} ({other.uid})"
                    )

    def _check_share_capacity(
        self, others: Iterable[ClaimRecord], ours: Sequence[AllocatedDevice]
    ) -> None:
        """The scheduler never over-commits a shared GPU; this is the last line of defence
        (a stale allocation, a second scheduler, a bug)."""
        shares = [d for d in ours if d.share_id is not None]
        if not shares:
            return
        held: dict[str, dict[str, int]] = {}
        for other in others:
            for device in other.devices:
                if device.share_id is not None:
                    _add(held.setdefault(device.device_name, {}), device.consumed_capacity)
        for share in shares:
            gpu = self.devices.gpu(share.device)
            if gpu is None:
                continue
            totals = held.setdefault(share.device, {})
            _add(totals, share.consumed_capacity)
            limits = {"memory": gpu.memory_mib * MIB, "compute": 100}
            for name, limit in limits.items():
                if totals.get(name, 0) > limit:
                    raise PrepareError(
                        f"share {share.share_id} of {share.device} would take {name} to "
                        f"{_show(name, totals[name])} of {_show(name, limit)}: the device's "
                        "other shares already hold the rest"
                    )

    def _write_spec(
        self,
        claim: ClaimView,
        devices: Sequence[CdiDevice],
        env: Mapping[str, str],
        mounts: Sequence[tuple[str, str]],
    ) -> None:
        identity = ClaimIdentity(claim.uid, claim.namespace, claim.name)
        spec = render_claim_spec(identity, devices, env, mounts)
        atomic_write_bytes(self.spec_path(claim.uid), encode_spec(spec))

    def undo(self, record: ClaimRecord, all_records: Iterable[ClaimRecord]) -> None:
        """Removes everything the record says was (or may have been) created or changed.
        Shared state (an MPS daemon, a time-slice setting) is released only when no other
        claim still uses it."""
        others = [r for r in all_records if r.uid != record.uid]
        path = record.created.cdi_spec_path
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        backend = self.devices.backend
        for index in record.created.time_slices:
            if not any(index in r.created.time_slices for r in others):
                _ignore_lost_gpu(backend.set_time_slice, int(index), TimeSliceInterval.DEFAULT)
        for instance in record.created.mig_instances:
            _ignore_lost_gpu(self._destroy_partition, instance)
        share = record.created.mps_share
        gpu_in_use = share is not None and any(
            r.created.mps_share and r.created.mps_share.gpu_index == share.gpu_index for r in others
        )
        if share is not None and share.gpu_index is not None and not gpu_in_use:
            _ignore_lost_gpu(backend.stop_mps_daemon, share.gpu_index)

    def _destroy_partition(self, record: MigInstanceRecord) -> None:
        if record.parent_index is None:
            return
        backend = self.devices.backend
        for instance in backend.list_mig_devices(record.parent_index):
            if instance.placement.start == record.placement_start and (
                record.profile_id is None or instance.profile_id == record.profile_id
            ):
                backend.destroy_mig_device(record.parent_index, instance.gpu_instance_id)
                log.info(
                    "destroyed MIG %s at %s on GPU %d",
                    record.profile,
                    record.placement_start,
                    record.parent_index,
                )


def _ignore_lost_gpu(call: Callable[..., object], *args: object) -> None:
    # A GPU that is gone cannot be reset; what the claim changed went with it.
    try:
        call(*args)
    except (GpuLostError, NotFoundError) as err:
        log.warning("cannot restore GPU state: %s", err)


def _add(totals: dict[str, int], consumed: Mapping[str, str]) -> None:
    for name, text in consumed.items():
        try:
            totals[name] = totals.get(name, 0) + parse_quantity(text).ceil()
        except QuantityError:
            continue


def _show(name: str, value: int) -> str:
    return f"{value // MIB}Mi" if name == "memory" else f"{value}%"


def device_records(claim: ClaimView, ours: Sequence[AllocatedDevice]) -> list[DeviceRecord]:
    """One record per device (per share); a device serving several requests lists them."""
    by_device: dict[tuple[str, str | None], DeviceRecord] = {}
    for d in ours:
        key = (d.device, d.share_id)
        previous = by_device.get(key)
        names = (previous.request_names if previous else []) + [d.base_request]
        by_device[key] = DeviceRecord(
            request_names=sorted(set(names)),
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=[cdi_device_id(claim.uid)],
            share_id=d.share_id,
            consumed_capacity=dict(d.consumed_capacity),
            admin_access=d.admin_access,
        )
    return list(by_device.values())


def _prepared_devices(record: ClaimRecord) -> tuple[PreparedDevice, ...]:
    return tuple(
        PreparedDevice(
            pool_name=d.pool_name,
            device_name=d.device_name,
            cdi_device_ids=tuple(d.cdi_device_ids),
            request_names=tuple(d.request_names),
            share_id=d.share_id,
        )
        for d in record.devices
    )
