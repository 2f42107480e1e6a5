"""Prepare / unprepare of claims on this node: the crash-safe state machine.

Per claim: record ``PrepareStarted`` (with what is about to be created) -> create it (CDI spec,
...) -> record ``Prepared``. A SIGKILL between any two steps leaves a record that says what may
exist, so a retry or the next start can finish or roll back. Unprepare works from the
checkpoint alone: the claim object may already be gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from driver.atomic_file import atomic_write_bytes
from driver.cdi import (
    CdiDevice,
    ClaimIdentity,
    cdi_device_id,
    encode_spec,
    render_claim_spec,
    spec_file_name,
)
from driver.names import DRIVER_NAME
from kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    CreatedResources,
    DeviceRecord,
)
from kubelet_plugin.claim_source import AllocatedDevice, ClaimSource, ClaimView
from kubelet_plugin.claims import ClaimRef, PreparedDevice, PrepareResult, UnprepareResult
from kubelet_plugin.prepare_lock import PrepareLock

log = logging.getLogger(__name__)

# Resolves a device name of this node's pool to what its CDI edits need; None if unknown.
DeviceResolver = Callable[[str], CdiDevice | None]


class PrepareError(Exception):
    """A claim cannot be prepared; the message goes to the kubelet (and the pod's events)."""


class ClaimPreparerImpl:
    """Implements the gRPC service's ClaimPreparer for whole GPUs."""

    def __init__(
        self,
        *,
        node_name: str,
        claims: ClaimSource,
        resolve_device: DeviceResolver,
        store: CheckpointStore,
        lock: PrepareLock,
        cdi_dir: Path,
        crash_at: str | None = None,
    ) -> None:
        self.node_name = node_name
        # Fault injection for crash tests (FLEXGPU_FAULT_CRASH_AT): SIGKILL ourselves at a
        # named step, exactly as an OOM kill or node shutdown would interrupt us.
        self._crash_at = crash_at
        self._claims = claims
        self._resolve = resolve_device
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
                except Exception as err:  # API or disk trouble: that claim fails, not the batch
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
                    self.undo(record)
                    checkpoint = checkpoint.without_claim(ref.uid)
                    self._store.save(checkpoint)
                    results[ref.uid] = UnprepareResult()
                except Exception as err:
                    log.exception("unpreparing claim %s/%s failed", ref.namespace, ref.name)
                    results[ref.uid] = UnprepareResult(
                        error=f"unpreparing claim {ref.namespace}/{ref.name}: {err}"
                    )
        return results

    # -- state ---------------------------------------------------------------------------
    def load_checkpoint(self) -> Checkpoint:
        """The current checkpoint. Start-up reconcile has already dealt with stale or corrupt
        files; one that turns bad later is treated the same way, without losing the claims
        recorded in the CDI directory (see reconcile)."""
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
        cdi_devices = [self._device(d) for d in ours]
        self._check_conflicts(checkpoint, claim, ours)
        if existing is not None:
            # A half-done earlier attempt (plugin killed mid-way): undo it, then start over.
            self.undo(existing)
        records = device_records(claim, ours)
        record = ClaimRecord(
            uid=claim.uid,
            namespace=claim.namespace,
            name=claim.name,
            state=ClaimState.PREPARE_STARTED,
            devices=records,
            created=CreatedResources(cdi_spec_path=str(self.spec_path(claim.uid))),
        )
        checkpoint = checkpoint.with_claim(record)
        self._store.save(checkpoint)
        self._maybe_crash("after-prepare-started")
        self._write_spec(claim, cdi_devices)
        self._maybe_crash("after-cdi-written")
        checkpoint = checkpoint.with_claim(record.model_copy(update={"state": ClaimState.PREPARED}))
        self._store.save(checkpoint)
        log.info(
            "prepared claim %s/%s: %s",
            claim.namespace,
            claim.name,
            ", ".join(d.device for d in ours) or "no devices of this node",
        )
        return checkpoint, _prepared_devices(checkpoint.claims[claim.uid])

    def _maybe_crash(self, step: str) -> None:
        if self._crash_at == step:
            log.warning("fault injection: SIGKILL at %s", step)
            os.kill(os.getpid(), signal.SIGKILL)

    def _device(self, allocated: AllocatedDevice) -> CdiDevice:
        device = self._resolve(allocated.device)
        if device is None:
            raise PrepareError(
                f"device {allocated.device} (request {allocated.request}) is not published by "
                f"node {self.node_name}; the allocation is out of date"
            )
        return device

    def _check_conflicts(
        self, checkpoint: Checkpoint, claim: ClaimView, ours: Sequence[AllocatedDevice]
    ) -> None:
        exclusive = {d.device for d in ours if not d.admin_access and d.share_id is None}
        for other in checkpoint.claims.values():
            if other.uid == claim.uid:
                continue
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

    def _write_spec(self, claim: ClaimView, devices: Sequence[CdiDevice]) -> None:
        spec = render_claim_spec(ClaimIdentity(claim.uid, claim.namespace, claim.name), devices)
        atomic_write_bytes(self.spec_path(claim.uid), encode_spec(spec))

    def undo(self, record: ClaimRecord) -> None:
        """Removes everything the record says was (or may have been) created."""
        path = record.created.cdi_spec_path
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def device_records(claim: ClaimView, ours: Sequence[AllocatedDevice]) -> list[DeviceRecord]:
    """One record per device; a device serving several requests lists them all."""
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
