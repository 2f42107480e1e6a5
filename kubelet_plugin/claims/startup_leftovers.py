"""What start-up reconcile reports, and its last step: leftovers no claim record owns (CDI
specs, device metadata folders, MPS daemons, dynamic-MIG instances, temp files of killed
writes) are removed."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from flexgpu.driver.cdi import ENV_MPS_PIPE, claim_uid_from_spec_file
from flexgpu.driver.mps_daemon_spec import serves_mig
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.spec_facts import spec_facts

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    rolled_back: list[str] = field(default_factory=list)
    orphan_specs_removed: list[str] = field(default_factory=list)
    # Device metadata folders (by claim UID) that no record owns.
    orphan_metadata_removed: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    migrated: list[str] = field(default_factory=list)
    # After a reboot: the records of the earlier boot, and what was reset for them.
    stale_dropped: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    mps_daemons_stopped: list[int] = field(default_factory=list)
    mig_instances_destroyed: list[str] = field(default_factory=list)
    # What the rebuilt records hold.
    rebuilt_mig: int = 0
    rebuilt_mps: int = 0
    rebuilt_time_slices: int = 0
    # Specs of an earlier boot found while rebuilding: never used, deleted as orphans.
    earlier_boot_specs: list[str] = field(default_factory=list)
    write_failures: list[str] = field(default_factory=list)
    checkpoint_status: str = ""


@dataclass(frozen=True)
class SpecReferences:
    mig_uuids: frozenset[str]
    mps_pipes: frozenset[str]


def spec_references(cdi_dir: Path) -> SpecReferences:
    """What the CDI specs on disk hand to containers: never destroyed or stopped here."""
    uuids: set[str] = set()
    pipes: set[str] = set()
    for path in our_specs(cdi_dir):
        facts = spec_facts(path)
        if facts is None:
            continue
        uuids.update(d.uuid for d in facts.devices if d.uuid)
        if facts.env.get(ENV_MPS_PIPE):
            pipes.add(facts.env[ENV_MPS_PIPE])
    return SpecReferences(frozenset(uuids), frozenset(pipes))


def destroy_unowned_partitions(
    preparer: ClaimPreparerImpl,
    records: Iterable[ClaimRecord],
    in_specs: SpecReferences,
    report: ReconcileReport,
) -> None:
    """On dynamic-MIG GPUs every instance belongs to a prepared claim; others are leftovers
    of a crash (created, then the plugin died before recording it) and are destroyed."""
    owned_at: set[tuple[int | None, int]] = set()
    owned_uuids: set[str] = set(in_specs.mig_uuids)
    for record in records:
        for m in record.created.mig_instances:
            owned_at.add((m.parent_index, m.placement_start))
            if m.uuid:
                owned_uuids.add(m.uuid)
    backend = preparer.devices.backend
    for index in sorted(preparer.devices.dynamic_gpus()):
        for instance in backend.list_mig_devices(index):
            if (index, instance.placement.start) in owned_at or instance.uuid in owned_uuids:
                continue
            backend.destroy_mig_device(index, instance.gpu_instance_id)
            report.mig_instances_destroyed.append(
                f"gpu-{index} {instance.profile_name}@{instance.placement.start}"
            )


def stop_unused_mps_daemons(
    preparer: ClaimPreparerImpl,
    records: Iterable[ClaimRecord],
    in_specs: SpecReferences,
    report: ReconcileReport,
) -> None:
    """Daemons of prepared claims are adopted as they run; any other one is a leftover. A
    whole GPU's daemon is in use while a share on that GPU is; a MIG device daemon while a
    record names its key UUID (one claim's own)."""
    shares = [r.created.mps_share for r in records if r.created.mps_share is not None]
    gpus_in_use = {s.gpu_index for s in shares if not s.mig}
    keys_in_use = {u for s in shares if s.mig for u in s.gpu_uuids}
    try:
        running = preparer.mps.running()
    except Exception as err:
        # Daemon pods are listed from the API server: while it is away, start-up goes on
        # (prepare and unprepare are served from local state) and leftovers stay until the
        # next start; stopping nothing is the safe side.
        log.warning("MPS daemons not checked for leftovers: %s", err)
        return
    for daemon in running:
        if daemon.pipe_dir in in_specs.mps_pipes:
            continue
        if serves_mig(daemon):
            if daemon.gpu_uuid not in keys_in_use:
                preparer.mps.stop_mig(daemon.gpu_index, daemon.gpu_uuid)
                report.mps_daemons_stopped.append(daemon.gpu_index)
        elif daemon.gpu_index not in gpus_in_use:
            preparer.mps.stop(daemon.gpu_index)
            report.mps_daemons_stopped.append(daemon.gpu_index)


def our_specs(cdi_dir: Path) -> list[Path]:
    if not cdi_dir.is_dir():
        return []
    return sorted(p for p in cdi_dir.iterdir() if claim_uid_from_spec_file(p.name))


def remove_temp_files(folder: Path) -> None:
    # Left by a write that was killed between creating its temp file and the rename.
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if path.name.startswith(".") and path.name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
