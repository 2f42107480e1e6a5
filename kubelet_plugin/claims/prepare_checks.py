"""What prepare checks against the node's other claims before it changes anything: no device
prepared twice, no shared GPU over-committed, no GPU shared by two namespaces (tenancy.py).
The scheduler never allocates any of these; these checks are the last line of defence (a
stale allocation, a second scheduler, a bug). They read checkpoint records, taken under the
GPUs' locks, and never the hardware."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.quantity import QuantityError, parse_quantity
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, DeviceRecord
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.sharing import SharingPlan, plan_sharing
from flexgpu.kubelet_plugin.claims.tenancy import SharedGpuTenants, check_one_tenant
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

__all__ = [
    "ClaimConflictError",
    "check_conflicts",
    "check_share_capacity",
    "gpu_index_of",
    "shared_gpus",
]

MIB = 1024 * 1024


class ClaimConflictError(ValueError):
    """The claim's devices are held by other claims; the text names device and claim, and
    ``holders`` the UIDs of the claims whose unprepare would end the conflict."""

    def __init__(self, message: str, holders: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.holders = tuple(sorted(set(holders)))


def check_conflicts(
    others: Iterable[ClaimRecord], ours: Sequence[AllocatedDevice], namespace: str
) -> None:
    """No device of a claim of ``namespace`` is prepared for another claim. The message
    reaches the refused claim's namespace (its pod's Events): it names the holding claim only
    when that is of the same namespace; the plugin's log names it always (preparer)."""
    exclusive = {d.device for d in ours if not d.admin_access and d.share_id is None}
    for other in others:
        for device in other.devices:
            if (
                device.device_name in exclusive
                and device.share_id is None
                and not device.admin_access
            ):
                holder = (
                    f"claim {other.namespace}/{other.name} ({other.uid})"
                    if other.namespace == namespace
                    else "a claim of another namespace"
                )
                raise ClaimConflictError(
                    f"device {device.device_name} is already prepared for {holder}",
                    holders=(other.uid,),
                )


def check_share_capacity(
    others: Iterable[ClaimRecord], ours: Sequence[AllocatedDevice], devices: NodeDevices
) -> None:
    """No shared GPU's shares add up to more memory or compute than it has."""
    shares = [d for d in ours if d.share_id is not None]
    if not shares:
        return
    held: dict[str, dict[str, int]] = {}
    holders: dict[str, set[str]] = {}
    for other in others:
        for device in other.devices:
            if device.share_id is not None:
                _add(held.setdefault(device.device_name, {}), _recorded(device))
                holders.setdefault(device.device_name, set()).add(other.uid)
    for share in shares:
        gpu = devices.gpu(share.device)
        if gpu is None:
            continue
        totals = held.setdefault(share.device, {})
        granted = share.consumed_capacity or {}
        _add(totals, {name: q.ceil() for name, q in granted.items()})
        limits = {"memory": gpu.memory_mib * MIB, "compute": 100}
        for name, limit in limits.items():
            if totals.get(name, 0) > limit:
                raise ClaimConflictError(
                    f"share {share.share_id} of {share.device} would take {name} to "
                    f"{_show(name, totals[name])} of {_show(name, limit)}: the device's "
                    "other shares already hold the rest",
                    holders=holders.get(share.device, ()),
                )


def shared_gpus(
    ours: Sequence[AllocatedDevice], plan: SharingPlan, devices: NodeDevices
) -> set[int]:
    """The GPUs on which the claim would share with other claims: those of its fractions and
    the one whose MPS daemon would serve it (``tenancy.gpus_shared_by`` of its record). An
    admin-access claim shares none: it may look at any tenant's GPU."""
    if all(allocated.admin_access for allocated in ours):
        return set()
    indices = set()
    for allocated in ours:
        gpu = devices.gpu(allocated.device)
        if allocated.share_id is not None and not allocated.admin_access and gpu is not None:
            indices.add(gpu.index)
    if plan.mps is not None:
        indices.add(plan.mps.gpu_index)
    return indices


def gpu_index_of(devices: NodeDevices) -> Callable[[str], int | None]:
    def index(device_name: str) -> int | None:
        gpu = devices.gpu(device_name)
        return gpu.index if gpu is not None else None

    return index


def _add(totals: dict[str, int], amounts: Mapping[str, int]) -> None:
    for name, amount in amounts.items():
        totals[name] = totals.get(name, 0) + amount


def _recorded(device: DeviceRecord) -> dict[str, int]:
    """What a checkpoint record says its share holds; a value that is not a quantity (a record
    no current plugin writes) is left out rather than failing every later prepare."""
    amounts = {}
    for name, text in device.consumed_capacity.items():
        try:
            amounts[name] = parse_quantity(text).ceil()
        except QuantityError:
            continue
    return amounts


def _show(name: str, value: int) -> str:
    return f"{value // MIB}Mi" if name == "memory" else f"{value}%"


def admit(
    claim: ClaimView,
    ours: Sequence[AllocatedDevice],
    others: Sequence[ClaimRecord],
    devices: NodeDevices,
    tenants: SharedGpuTenants,
) -> SharingPlan:
    """The claim's sharing plan, once its devices are free of other claims, its shares fit
    and no other namespace shares its GPUs. Raises ClaimConflictError, SharingError or
    TenantMixError (the first two name the device, the last the GPU)."""
    check_conflicts(others, ours, claim.namespace)
    check_share_capacity(others, ours, devices)
    plan = plan_sharing(claim, ours, devices)
    check_one_tenant(
        claim.namespace, shared_gpus(ours, plan, devices), others, gpu_index_of(devices), tenants
    )
    return plan
