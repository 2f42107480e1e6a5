"""Start-up reconcile of the checkpoint, the CDI directory and the hardware.

Runs under the prepare lock before the plugin serves. It rolls back half-done claims, deletes
CDI specs nobody owns, discards a checkpoint from an earlier boot, and rebuilds state from the
CDI directory and the API when the checkpoint is corrupt, so the plugin keeps running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from driver.cdi import ENV_CLAIM_NAME, ENV_CLAIM_NAMESPACE, claim_uid_from_spec_file, spec_env
from driver.names import DRIVER_NAME
from kubelet_plugin.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimRecord,
    ClaimState,
    CorruptCheckpoint,
    CreatedResources,
    LoadStatus,
    MpsShareRecord,
)
from kubelet_plugin.claim_source import AllocatedDevice, ClaimSource
from kubelet_plugin.preparer import ENV_TIME_SLICE, ClaimPreparerImpl, device_records

log = logging.getLogger(__name__)

# (reason, message) -> records a Warning Event on the node; never raises.
EventSink = Callable[[str, str], None]


@dataclass
class ReconcileReport:
    rolled_back: list[str] = field(default_factory=list)
    orphan_specs_removed: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    mps_daemons_stopped: list[int] = field(default_factory=list)
    mig_instances_destroyed: list[str] = field(default_factory=list)
    checkpoint_status: str = ""


def reconcile_at_start(
    preparer: ClaimPreparerImpl,
    store: CheckpointStore,
    claims: ClaimSource,
    events: EventSink | None = None,
) -> ReconcileReport:
    report = ReconcileReport()
    try:
        loaded = store.load()
        checkpoint = loaded.checkpoint
        report.checkpoint_status = loaded.status.value
        if loaded.status == LoadStatus.STALE:
            # Everything it records (CDI specs in a tmpfs, MIG instances) went with the reboot;
            # what survived is an orphan and is removed below.
            checkpoint = store.empty()
    except CorruptCheckpoint as err:
        report.checkpoint_status = "corrupt"
        checkpoint = _rebuild_from_cdi(preparer, store, claims, report)
        if events:
            events(
                "CheckpointCorrupt",
                f"{err}. Rebuilt {len(report.rebuilt)} prepared claim(s) from the CDI "
                "directory and the API.",
            )

    for uid, record in list(checkpoint.claims.items()):
        if record.state == ClaimState.PREPARE_STARTED:
            preparer.undo(record, checkpoint.claims.values())
            checkpoint = checkpoint.without_claim(uid)
            report.rolled_back.append(f"{record.namespace}/{record.name}")
        else:
            report.kept.append(f"{record.namespace}/{record.name}")

    _stop_unused_mps_daemons(preparer, checkpoint, report)
    _destroy_unowned_partitions(preparer, checkpoint, report)
    owned = set(checkpoint.claims)
    for path in _our_specs(preparer.cdi_dir):
        if claim_uid_from_spec_file(path.name) not in owned:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            report.orphan_specs_removed.append(path.name)
    _remove_temp_files(preparer.cdi_dir)
    _remove_temp_files(store.path.parent)
    store.save(checkpoint)
    log.info(
        "start-up reconcile: checkpoint %s; kept %d, rolled back %d, rebuilt %d, removed %d "
        "orphan CDI spec(s), stopped %d MPS daemon(s) and destroyed %d MIG instance(s) no "
        "claim uses",
        report.checkpoint_status,
        len(report.kept),
        len(report.rolled_back),
        len(report.rebuilt),
        len(report.orphan_specs_removed),
        len(report.mps_daemons_stopped),
        len(report.mig_instances_destroyed),
    )
    return report


def _destroy_unowned_partitions(
    preparer: ClaimPreparerImpl, checkpoint: Checkpoint, report: ReconcileReport
) -> None:
    """On dynamic-MIG GPUs every instance belongs to a prepared claim; others are leftovers
    of a crash (created, then the plugin died before recording it) and are destroyed."""
    owned = {
        (m.parent_index, m.placement_start)
        for r in checkpoint.claims.values()
        for m in r.created.mig_instances
    }
    backend = preparer.devices.backend
    for index in sorted(preparer.devices.dynamic_gpus()):
        for instance in backend.list_mig_devices(index):
            if (index, instance.placement.start) not in owned:
                backend.destroy_mig_device(index, instance.gpu_instance_id)
                report.mig_instances_destroyed.append(
                    f"gpu-{index} {instance.profile_name}@{instance.placement.start}"
                )


def _stop_unused_mps_daemons(
    preparer: ClaimPreparerImpl, checkpoint: Checkpoint, report: ReconcileReport
) -> None:
    """Daemons of prepared claims are adopted as they run; any other one is a leftover."""
    in_use = {
        r.created.mps_share.gpu_index
        for r in checkpoint.claims.values()
        if r.created.mps_share is not None
    }
    backend = preparer.devices.backend
    for daemon in backend.mps_daemons():
        if daemon.gpu_index not in in_use:
            backend.stop_mps_daemon(daemon.gpu_index)
            report.mps_daemons_stopped.append(daemon.gpu_index)


def _created_from_env(
    preparer: ClaimPreparerImpl,
    spec_path: str,
    env: dict[str, str],
    ours: list[AllocatedDevice],
) -> CreatedResources:
    """What the claim's spec shows it set up: its MPS daemon (by pipe folder) and
    time-slicing on its GPUs, so rebuilt records keep those in use."""
    mps = None
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    for daemon in preparer.devices.backend.mps_daemons() if pipe else []:
        if daemon.pipe_dir == pipe:
            mps = MpsShareRecord(gpu_uuids=[daemon.gpu_uuid], gpu_index=daemon.gpu_index)
    slices = {}
    if ENV_TIME_SLICE in env:
        for allocated in ours:
            gpu = preparer.devices.gpu(allocated.device)
            if gpu is not None:
                slices[str(gpu.index)] = env[ENV_TIME_SLICE]
    return CreatedResources(cdi_spec_path=spec_path, mps_share=mps, time_slices=slices)


def _our_specs(cdi_dir: Path) -> list[Path]:
    if not cdi_dir.is_dir():
        return []
    return sorted(p for p in cdi_dir.iterdir() if claim_uid_from_spec_file(p.name))


def _remove_temp_files(folder: Path) -> None:
    # Left by a write that was killed between creating its temp file and the rename.
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _rebuild_from_cdi(
    preparer: ClaimPreparerImpl,
    store: CheckpointStore,
    claims: ClaimSource,
    report: ReconcileReport,
) -> Checkpoint:
    """Each spec of ours names its claim; keep those the API still shows allocated to us."""
    checkpoint = store.empty()
    for path in _our_specs(preparer.cdi_dir):
        uid = claim_uid_from_spec_file(path.name)
        try:
            env = spec_env(json.loads(path.read_bytes()))
        except (OSError, ValueError):
            continue  # unreadable: removed as an orphan
        namespace, name = env.get(ENV_CLAIM_NAMESPACE, ""), env.get(ENV_CLAIM_NAME, "")
        try:
            claim = claims.get(namespace, name) if namespace and name else None
        except Exception as err:  # API down: keep the spec's claim rather than lose it
            log.warning("cannot read claim %s/%s while rebuilding state: %s", namespace, name, err)
            claim = None
        if claim is None or claim.uid != uid or not claim.allocated:
            continue
        ours = [
            d for d in claim.devices if d.driver == DRIVER_NAME and d.pool == preparer.node_name
        ]
        created = _created_from_env(preparer, os.fspath(path), env, ours)
        checkpoint = checkpoint.with_claim(
            ClaimRecord(
                uid=claim.uid,
                namespace=claim.namespace,
                name=claim.name,
                state=ClaimState.PREPARED,
                devices=device_records(claim, ours),
                created=created,
            )
        )
        report.rebuilt.append(f"{claim.namespace}/{claim.name}")
    return checkpoint
