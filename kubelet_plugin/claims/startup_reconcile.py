"""Start-up reconcile of the checkpoint, the CDI directory and the hardware.

Runs under the exclusive node lock before the plugin serves, and writes only what changed. In
order, each step safe to repeat after a crash:

1. migrates a version-1 checkpoint file (records written, then the old file replaced by the
   rollback marker, which is also written wherever no file is: see checkpoint.py);
2. after a reboot, resets what records of the earlier boot say the plugin set (time-slices,
   MPS daemons, MIG instances) and drops them;
3. when a file is corrupt or of a newer version, rebuilds the records of claims whose CDI spec
   of this boot survives (a spec of an earlier boot is never used: spec_facts.py), with
   everything they hold: MIG instance (the spec's MIG UUID among the live instances), MPS
   share (pipe folder and limits in the spec's env) and time-slice (each device's
   FLEXGPU_DEVICE_* variable; FLEXGPU_TIME_SLICE in specs of earlier releases), checked
   against the API; corrupt files are set aside only once the rebuilt records are written,
   files of a newer version are never touched;
4. rolls back half-done claims (partitions made ready before binding are kept while binding
   conditions are on: early_partitions.py), deletes CDI specs and device metadata folders no
   record owns, then stops MPS daemons and destroys dynamic-MIG instances that no record and
   no surviving spec uses (a MIG device's daemon first: it holds its partition).

A write that fails (a full disk) does not stop the plugin: the record is held in memory, an
Event says so, and unprepare, which frees space, keeps working.
"""

from __future__ import annotations

import contextlib
import logging
import os

from flexgpu.driver.cdi import (
    ENV_MPS_PINNED,
    ENV_MPS_PIPE,
    ENV_MPS_THREADS,
    cdi_device_id,
    claim_uid_from_spec_file,
)
from flexgpu.driver.gpu_model import MigDevice
from flexgpu.driver.mps_daemon_spec import MIG_UUID_PREFIX, serves_mig
from flexgpu.driver.names import CDI_KIND, DRIVER_NAME
from flexgpu.kubelet_plugin.api.node_events import NodeEventSink
from flexgpu.kubelet_plugin.claims.checkpoint import (
    CheckpointStore,
    CheckpointWriteError,
    ScanResult,
)
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    SCHEMA_VERSION,
    ClaimRecord,
    ClaimState,
    CreatedResources,
    DeviceRecord,
    EarlyStage,
    MigInstanceRecord,
    MpsShareRecord,
)
from flexgpu.kubelet_plugin.claims.claim_source import ClaimSource
from flexgpu.kubelet_plugin.claims.prepare_records import device_records
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.spec_facts import (
    SpecFacts,
    read_boot_time,
    spec_facts,
    written_before_this_boot,
)
from flexgpu.kubelet_plugin.claims.startup_leftovers import (
    ReconcileReport,
    destroy_unowned_partitions,
    our_specs,
    remove_temp_files,
    spec_references,
    stop_unused_mps_daemons,
)

__all__ = ["ReconcileReport", "reconcile_at_start"]

log = logging.getLogger(__name__)

# (reason, message) -> records a Warning Event on the node; never raises.


def reconcile_at_start(
    preparer: ClaimPreparerImpl,
    store: CheckpointStore,
    claims: ClaimSource,
    events: NodeEventSink | None = None,
) -> ReconcileReport:
    report = ReconcileReport()
    scan = store.scan()
    report.checkpoint_status = _status(scan)
    records = dict(scan.current)
    if scan.legacy:
        # A version-1 file left beside version-2 files is at least as new (see migrate_legacy).
        records.update(scan.legacy)
        report.migrated = sorted(f"{r.namespace}/{r.name}" for r in scan.legacy.values())
        report.write_failures += [str(e) for e in store.migrate_legacy(scan.legacy)]
    elif scan.legacy_status == "stale":
        store.retire_legacy()
    if scan.stale:
        _reset_after_reboot(
            preparer, store, scan=scan, records=records, report=report, events=events
        )
    if scan.needs_rebuild:
        _rebuild(preparer, store, claims, scan=scan, records=records, report=report, events=events)

    # Partitions made ready before binding stay for prepare to take over while binding
    # conditions are on (the binding watch destroys them if their claim no longer waits).
    keep_early = preparer.devices.binding_conditions
    for uid, record in list(records.items()):
        early_ready = keep_early and record.early == EarlyStage.READY
        if record.state == ClaimState.PREPARE_STARTED and not early_ready:
            preparer.undo(record, records.values())
            store.delete(uid)
            del records[uid]
            report.rolled_back.append(f"{record.namespace}/{record.name}")
        else:
            report.kept.append(f"{record.namespace}/{record.name}")

    for path in our_specs(preparer.cdi_dir):
        if claim_uid_from_spec_file(path.name) not in records:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            report.orphan_specs_removed.append(path.name)
    # After the specs: a spec left would name files that are gone. A record owns a folder only
    # if it lists one (a record rebuilt from a spec of an earlier release does not).
    owners = {uid for uid, r in records.items() if r.created.metadata_dir}
    report.orphan_metadata_removed = preparer.metadata.remove_unowned(owners)
    in_specs = spec_references(preparer.cdi_dir)
    stop_unused_mps_daemons(preparer, records.values(), in_specs, report)
    destroy_unowned_partitions(preparer, records.values(), in_specs, report)
    remove_temp_files(preparer.cdi_dir)
    remove_temp_files(store.claims_dir)
    remove_temp_files(store.legacy_path.parent)
    # Last: a rollback to a schema-1 plugin must find the marker and stop (checkpoint.py).
    store.ensure_marker()
    if report.write_failures and events:
        events(
            "CheckpointWriteFailed",
            f"{report.write_failures[0]} ({len(report.write_failures)} record(s) not written). "
            f"The plugin keeps serving with {len(store.in_memory())} record(s) held in memory; "
            "preparing new claims fails until space is freed, unpreparing works.",
        )
    log.info(
        "start-up reconcile: checkpoint %s; kept %d, rolled back %d, rebuilt %d, migrated %d, "
        "dropped %d record(s) of an earlier boot, removed %d orphan CDI spec(s) and %d device "
        "metadata folder(s), stopped %d MPS daemon(s) and destroyed %d MIG instance(s) no claim "
        "uses",
        report.checkpoint_status,
        len(report.kept),
        len(report.rolled_back),
        len(report.rebuilt),
        len(report.migrated),
        len(report.stale_dropped),
        len(report.orphan_specs_removed),
        len(report.orphan_metadata_removed),
        len(report.mps_daemons_stopped),
        len(report.mig_instances_destroyed),
    )
    return report


def _status(scan: ScanResult) -> str:
    if scan.foreign:
        return "foreign"
    if scan.corrupt:
        return "corrupt"
    if scan.stale:
        return "stale"
    if scan.legacy:
        return "migrated"
    return "current" if scan.current else "missing"


# -- after a reboot ----------------------------------------------------------------------


def _reset_after_reboot(
    preparer: ClaimPreparerImpl,
    store: CheckpointStore,
    *,
    scan: ScanResult,
    records: dict[str, ClaimRecord],
    report: ReconcileReport,
    events: NodeEventSink | None,
) -> None:
    """Pods of an earlier boot are gone, but settings may outlive a reboot (and the
    simulator's state does): undo what each record made, then drop it."""
    old_boots = sorted({boot for boot, _ in scan.stale})
    for _, record in scan.stale:
        report.reset += preparer.undo(record, records.values())
        if record.uid not in records:
            store.delete(record.uid)
        report.stale_dropped.append(f"{record.namespace}/{record.name}")
    summary = (
        f"Checkpoint records of an earlier boot ({', '.join(old_boots)}; this boot is "
        f"{store.boot_id}): dropped {len(report.stale_dropped)} claim record(s) "
        f"({', '.join(report.stale_dropped)}); reset: "
        f"{'; '.join(report.reset) or 'nothing was left set'}."
    )
    log.warning("%s", summary)
    if events:
        events("CheckpointFromEarlierBoot", summary)


# -- rebuild from CDI specs --------------------------------------------------------------


def _rebuild(
    preparer: ClaimPreparerImpl,
    store: CheckpointStore,
    claims: ClaimSource,
    *,
    scan: ScanResult,
    records: dict[str, ClaimRecord],
    report: ReconcileReport,
    events: NodeEventSink | None,
) -> None:
    # Copies of the corrupt files first; the files themselves go only once the records that
    # replace them are written: a crash before that finds them again and rebuilds again.
    copies = [(c, store.set_aside(c)) for c in scan.corrupt]
    rebuilt = _rebuild_from_cdi(preparer, claims, set(records), report, store.boot_id)
    failed = False
    for record in rebuilt:
        try:
            store.put(record)
        except CheckpointWriteError as err:
            store.keep_in_memory(record)
            report.write_failures.append(str(err))
            failed = True
        records[record.uid] = record
    if not failed:
        for corrupt, copy in copies:
            store.remove_corrupt(corrupt, copy)
    what = (
        f"Rebuilt {len(rebuilt)} prepared claim(s){_names(report.rebuilt)} holding "
        f"{report.rebuilt_mig} MIG instance(s), {report.rebuilt_mps} MPS share(s) and "
        f"{report.rebuilt_time_slices} time-slice setting(s) from the CDI specs in "
        f"{preparer.cdi_dir}, checked against the API server; nothing they use was changed."
    )
    if report.earlier_boot_specs:
        what += (
            f" {len(report.earlier_boot_specs)} CDI spec(s) of an earlier boot"
            f"{_names(report.earlier_boot_specs)} were not used and are deleted: their claims "
            "are prepared afresh."
        )
    if scan.corrupt:
        files = ", ".join(
            f"{c.path} ({c.reason[:120]}; {f'copy kept as {to.name}' if to else 'no copy kept'})"
            for c, to in copies
        )
        message = f"Corrupt checkpoint file(s): {files}. {what}"
        log.error("%s", message)
        if events:
            events("CheckpointCorrupt", message)
    if scan.foreign:
        files = ", ".join(f"{f.path} (schema version {f.version})" for f in scan.foreign)
        message = (
            f"Checkpoint file(s) of a newer plugin: {files}; this plugin reads schema versions "
            f"up to {SCHEMA_VERSION} and left them untouched. {what}"
        )
        log.error("%s", message)
        if events:
            events("CheckpointVersionUnsupported", message)


def _names(names: list[str]) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:10])
    return f" ({shown}{', ...' if len(names) > 10 else ''})"


def _rebuild_from_cdi(
    preparer: ClaimPreparerImpl,
    claims: ClaimSource,
    known: set[str],
    report: ReconcileReport,
    boot_id: str,
) -> list[ClaimRecord]:
    """A record for each spec of ours of this boot with none, when the API still shows the
    claim allocated to us (or cannot be asked: then the spec alone is trusted, not deleted).
    A spec of an earlier boot names what the reboot took away (spec_facts.py): it rebuilds
    nothing and goes as an orphan."""
    live = _live_partitions(preparer)
    boot_time = read_boot_time()
    rebuilt = []
    for path in our_specs(preparer.cdi_dir):
        uid = claim_uid_from_spec_file(path.name)
        if uid is None or uid in known:
            continue
        facts = spec_facts(path)
        if facts is None:
            continue
        if written_before_this_boot(path, facts, boot_id, boot_time):
            report.earlier_boot_specs.append(path.name)
            continue
        namespace, name = facts.namespace, facts.name
        if not namespace or not name:
            continue
        try:
            claim = claims.get(namespace, name)
        except Exception as err:  # API down: keep the spec's claim rather than lose it
            log.warning("cannot read claim %s/%s while rebuilding state: %s", namespace, name, err)
            devices = _devices_from_spec(preparer, uid, facts)
        else:
            if claim is None or claim.uid != uid or not claim.allocated:
                continue
            ours = [
                d for d in claim.devices if d.driver == DRIVER_NAME and d.pool == preparer.node_name
            ]
            devices = device_records(claim, ours, metadata=facts.metadata_requests)
        created = _created_from_spec(preparer, uid, os.fspath(path), facts, live)
        report.rebuilt_mig += len(created.mig_instances)
        report.rebuilt_mps += created.mps_share is not None
        report.rebuilt_time_slices += len(created.time_slices)
        rebuilt.append(
            ClaimRecord(
                uid=uid,
                namespace=namespace,
                name=name,
                state=ClaimState.PREPARED,
                devices=devices,
                created=created,
            )
        )
        report.rebuilt.append(f"{namespace}/{name}")
    return rebuilt


def _devices_from_spec(
    preparer: ClaimPreparerImpl, uid: str, facts: SpecFacts
) -> list[DeviceRecord]:
    return [
        DeviceRecord(
            pool_name=preparer.node_name,
            device_name=d.name,
            share_id=d.share_id,
            cdi_device_ids=[
                f"{CDI_KIND}={uid}" if facts.legacy else cdi_device_id(uid, d.name, d.share_id)
            ],
        )
        for d in facts.devices
        if d.name
    ]


def _live_partitions(preparer: ClaimPreparerImpl) -> dict[str, MigDevice]:
    """Instances on dynamic-MIG GPUs by UUID: the ones prepare creates."""
    live = {}
    for index in sorted(preparer.devices.dynamic_gpus()):
        for instance in preparer.devices.backend.list_mig_devices(index):
            if instance.uuid is not None:
                live[instance.uuid] = instance
    return live


def _created_from_spec(
    preparer: ClaimPreparerImpl,
    uid: str,
    spec_path: str,
    facts: SpecFacts,
    live: dict[str, MigDevice],
) -> CreatedResources:
    """What the claim's spec shows it holds: the MIG instances its MIG UUIDs name, its MPS
    daemon (by pipe folder) with its limits, time-slicing on its GPUs, and the device
    metadata folder whose files it mounts."""
    env = facts.env
    mig = []
    for uuid in (d.uuid for d in facts.devices if d.uuid):
        instance = live.get(uuid)
        if instance is not None:
            mig.append(
                MigInstanceRecord(
                    parent_uuid=instance.parent_uuid,
                    parent_index=instance.parent_index,
                    profile=instance.profile_name,
                    profile_id=instance.profile_id,
                    placement_start=instance.placement.start,
                    placement_size=instance.placement.size,
                    gpu_instance_id=instance.gpu_instance_id,
                    compute_instance_id=instance.compute_instance_id,
                    uuid=instance.uuid,
                )
            )
    mps = None
    pipe = env.get(ENV_MPS_PIPE)
    for daemon in preparer.mps.running() if pipe else []:
        if daemon.pipe_dir == pipe:
            # A MIG device daemon is known by its key UUID, which is all undo needs; the
            # other devices it serves are the spec's MIG devices.
            on_mig = serves_mig(daemon)
            mps = MpsShareRecord(
                gpu_uuids=[daemon.gpu_uuid],
                gpu_index=daemon.gpu_index,
                pipe_dir=pipe,
                active_thread_percentage=_int(env.get(ENV_MPS_THREADS)),
                pinned_memory_limits=_pinned(env.get(ENV_MPS_PINNED)),
                mig=on_mig,
                devices=[d.name for d in facts.devices if d.name and _is_mig_uuid(d.uuid)]
                if on_mig
                else [],
            )
    slices = {}
    for device in facts.devices:
        gpu = preparer.devices.gpu(device.name) if device.time_slice else None
        if gpu is not None and device.time_slice:
            slices[str(gpu.index)] = device.time_slice
    return CreatedResources(
        cdi_spec_path=spec_path,
        mig_instances=mig,
        mps_share=mps,
        time_slices=slices,
        metadata_dir=preparer.metadata.claim_dir(uid) if facts.metadata_requests else None,
    )


def _is_mig_uuid(uuid: str) -> bool:
    return uuid.startswith(MIG_UUID_PREFIX)


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _pinned(text: str | None) -> dict[str, str]:
    """``0=4096M,1=...`` (what prepare writes) as the record's {"0": "4096Mi"}."""
    limits = {}
    for item in (text or "").split(","):
        key, _, value = item.partition("=")
        if key and value.endswith("M") and value[:-1].isdigit():
            limits[key] = f"{value[:-1]}Mi"
    return limits
