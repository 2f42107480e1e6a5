"""What the preparer records and reports about a claim: checkpoint records of its devices
and MIG instances, the devices the kubelet is told, and the status the user sees."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from flexgpu.driver.cdi import CdiDevice, cdi_device_id, metadata_device_id
from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.gpu_model import MigDevice, MpsDaemon
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_READY_CONDITION,
    TENANT_READY_CONDITION,
)
from flexgpu.kubelet_plugin.claims.checkpoint_records import (
    ClaimRecord,
    CreatedResources,
    DeviceRecord,
    MigInstanceRecord,
    MpsShareRecord,
)
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.claim_status import PREPARED, Condition, DeviceStatus
from flexgpu.kubelet_plugin.claims.sharing import SharingPlan
from flexgpu.kubelet_plugin.claims.tenant_binding import tenant_ready
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import PreparedDevice


def device_status(
    devices: NodeDevices,
    ours: Sequence[AllocatedDevice],
    cdi_devices: Sequence[CdiDevice],
    plan: SharingPlan,
    record_share: MpsShareRecord | None = None,
    *,
    namespace: str = "",
) -> list[DeviceStatus]:
    """What the user sees in the claim's status for each device (of a claim of
    ``namespace``)."""
    result = []
    by_key = {(c.device_name, c.share_id): c for c in cdi_devices}
    for allocated in ours:
        cdi = by_key[(allocated.device, allocated.share_id)]
        gpu = devices.gpu(allocated.device)
        data: dict[str, Any] = {"uuid": cdi.uuid}
        if gpu is not None:
            data["productName"] = gpu.product_name
        part = devices.partition(allocated.device)
        if part is not None:
            data["migProfile"] = part.profile_name
            data["placement"] = {"start": part.placement.start, "size": part.placement.size}
        if allocated.share_id is not None:
            data["granted"] = allocated.consumed_texts()
        mig_mps = mig_mps_status(record_share, cdi.uuid)
        if mig_mps is not None:
            data["mps"] = mig_mps
        elif plan.mps is not None:
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
        conditions: tuple[Condition, ...] = (PREPARED,)
        if PARTITION_READY_CONDITION in allocated.binding_conditions:
            # Kept true once prepared: the scheduler checks it for every pod of the claim.
            conditions += (partition_ready(cdi.uuid),)
        if TENANT_READY_CONDITION in allocated.binding_conditions and gpu is not None:
            conditions += (tenant_ready(gpu.index, namespace),)
        result.append(
            DeviceStatus(allocated.pool, allocated.device, allocated.share_id, data, conditions)
        )
    return result


def intended_partitions(
    devices: NodeDevices, node_name: str, claim: ClaimView
) -> list[MigInstanceRecord]:
    """The MIG instances a claim's dynamic-MIG devices of this node need."""
    records = []
    for d in claim.devices:
        part = devices.partition(d.device) if d.pool == node_name else None
        if part is None or d.driver != DRIVER_NAME:
            continue
        parent = devices.gpus_by_index().get(part.parent_index)
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


def with_ids(created: CreatedResources, devices: Sequence[MigDevice]) -> CreatedResources:
    """The intended MIG records completed with what was created, so that undo and a
    rebuild after a lost record find the instance by its UUID."""
    by_place = {(d.parent_index, d.placement.start): d for d in devices}
    records = []
    for intended in created.mig_instances:
        made = by_place.get((intended.parent_index or 0, intended.placement_start))
        if made is not None and intended.parent_index is not None:
            intended = intended.model_copy(  # noqa: PLW2901 - the completed record replaces it
                update={
                    "uuid": made.uuid,
                    "gpu_instance_id": made.gpu_instance_id,
                    "compute_instance_id": made.compute_instance_id,
                }
            )
        records.append(intended)
    return created.model_copy(update={"mig_instances": records})


def mig_share_record(
    devices: Sequence[str], spec: MigMpsDaemonSpec, daemon: MpsDaemon
) -> MpsShareRecord:
    return MpsShareRecord(
        gpu_uuids=list(spec.device_uuids),
        gpu_index=spec.parent_index,
        pipe_dir=daemon.pipe_dir,
        active_thread_percentage=spec.active_thread_percentage,
        pinned_memory_limits={
            str(i): f"{mib}Mi" for i, mib in enumerate(spec.pinned_memory_mib) if mib is not None
        },
        mig=True,
        devices=list(devices),
    )


def mig_mps_status(share: MpsShareRecord | None, uuid: str) -> dict[str, Any] | None:
    """The MPS limits a MIG device's clients got, as its share record holds them."""
    if share is None or not share.mig or uuid not in share.gpu_uuids:
        return None
    data: dict[str, Any] = {}
    if share.active_thread_percentage is not None:
        data["activeThreadPercentage"] = share.active_thread_percentage
    pinned = share.pinned_memory_limits.get(str(share.gpu_uuids.index(uuid)))
    if pinned is not None:
        data["pinnedDeviceMemoryLimit"] = pinned
    return data


def device_records(
    claim: ClaimView,
    ours: Sequence[AllocatedDevice],
    metadata: Collection[str] | None = None,
) -> list[DeviceRecord]:
    """One record per device (per share); a device serving several requests lists them.
    Each request's device metadata CDI device goes with one of its devices (the kubelet hands
    a container the CDI devices of the requests it names): one that serves no other request
    where there is one. ``metadata``: the requests whose spec has one (None: all of them;
    a spec written before device metadata has none)."""
    # The last result of a device describes it, in the order its first result has.
    last: dict[tuple[str, str | None], AllocatedDevice] = {}
    requests: dict[tuple[str, str | None], set[str]] = {}
    for d in ours:
        key = (d.device, d.share_id)
        last[key] = d
        requests.setdefault(key, set()).add(d.base_request)
    ids = {key: [cdi_device_id(claim.uid, key[0], key[1])] for key in last}
    wanted = {d.base_request for d in ours}
    for request in sorted(wanted if metadata is None else wanted & set(metadata)):
        serving = [key for key in last if request in requests[key]]
        carrier = next((k for k in serving if requests[k] == {request}), serving[0])
        ids[carrier].append(metadata_device_id(claim.uid, request))
    return [
        DeviceRecord(
            request_names=sorted(requests[key]),
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=ids[key],
            share_id=d.share_id,
            consumed_capacity=d.consumed_texts(),
            admin_access=d.admin_access,
        )
        for key, d in last.items()
    ]


def one_per_device(ours: Sequence[AllocatedDevice]) -> list[AllocatedDevice]:
    """One entry per device (per share): a device serving two requests is prepared once."""
    seen: dict[tuple[str, str | None], AllocatedDevice] = {}
    for allocated in ours:
        seen.setdefault((allocated.device, allocated.share_id), allocated)
    return list(seen.values())


def prepared_devices(record: ClaimRecord) -> tuple[PreparedDevice, ...]:
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


def partition_ready(uuid: str) -> Condition:
    """The binding condition of an on-demand MIG partition that exists."""
    return Condition(PARTITION_READY_CONDITION, "True", "Created", f"MIG device {uuid} created")


def intended_resources(
    devices: NodeDevices,
    node_name: str,
    spec_file: str,
    claim: ClaimView,
    plan: SharingPlan,
    *,
    metadata_dir: str | None = None,
) -> CreatedResources:
    """What prepare is about to create or change for the claim, recorded before it does."""
    mps = None
    if plan.mig_mps is not None:
        # The daemon's UUIDs come once the devices exist (sharing_setup.py); until then undo
        # finds it through the devices' names and the record's MIG instances.
        mps = MpsShareRecord(
            gpu_uuids=[],
            mig=True,
            devices=list(plan.mig_mps.devices),
            active_thread_percentage=(
                plan.mig_mps.config.defaultActiveThreadPercentage if plan.mig_mps.config else None
            ),
        )
    elif plan.mps is not None:
        gpu = devices.gpus_by_index().get(plan.mps.gpu_index)
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
        cdi_spec_path=spec_file,
        mig_instances=intended_partitions(devices, node_name, claim),
        mps_share=mps,
        time_slices={str(i): str(v) for i, v in plan.time_slices.items()},
        metadata_dir=metadata_dir,
    )
