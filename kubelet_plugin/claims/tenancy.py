"""Who may share a GPU: the namespace is the tenant boundary.

A GPU shared across claims (fractions of a shared GPU, the GPU's MPS control daemon) serves
the claims of one namespace at a time: the clients of one MPS daemon can end each other's
work (``quit`` on the control pipe), read and write each other's shared memory and exceed a
limit that is only set in their own environment, so two tenants never meet there unless the
administrator says they may (``--shared-gpu-tenants=any``; docs/security.md says what one
tenant can then do to the other). This check in prepare refuses the mix whatever allocated
it; docs/security.md says what keeps the scheduler from producing it. Pure: it reads
checkpoint records only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from typing import Literal

from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord

__all__ = [
    "ONE_NAMESPACE",
    "SharedGpuTenants",
    "TenantMixError",
    "check_one_tenant",
    "gpus_shared_by",
    "tenants_by_gpu",
]

SharedGpuTenants = Literal["namespace", "any"]
ONE_NAMESPACE: SharedGpuTenants = "namespace"


class TenantMixError(ValueError):
    """Preparing the claim would let two namespaces share a GPU; the text says which, and
    ``holders`` the UIDs of the other namespace's claims that hold it."""

    def __init__(self, message: str, holders: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.holders = tuple(sorted(set(holders)))


def gpus_shared_by(record: ClaimRecord, gpu_of: Callable[[str], int | None]) -> set[int]:
    """The GPUs (by index) on which the record's claim shares with others: the GPUs of its
    fractions (devices with a share id) and the GPU whose MPS daemon serves it. A MIG
    device's daemon is the claim's own, and a whole GPU without MPS is the claim's alone.
    An admin-access claim (monitoring, allowed only in namespaces the administrator marks)
    holds no GPU for its namespace."""
    if record.devices and all(device.admin_access for device in record.devices):
        return set()
    shared = set()
    for device in record.devices:
        if device.share_id is not None and not device.admin_access:
            index = gpu_of(device.device_name)
            if index is not None:
                shared.add(index)
    share = record.created.mps_share
    if share is not None and not share.mig and share.gpu_index is not None:
        shared.add(share.gpu_index)
    return shared


def check_one_tenant(
    namespace: str,
    gpus: Set[int],
    others: Iterable[ClaimRecord],
    gpu_of: Callable[[str], int | None],
    tenants: SharedGpuTenants = ONE_NAMESPACE,
) -> None:
    """Raises ``TenantMixError`` when a claim of ``namespace`` that shares ``gpus`` would
    meet, on one of them, a claim of another namespace that the node has prepared (or begun
    to); its ``holders`` are those claims' UIDs. ``others`` are the node's other claim
    records, read under the GPUs' locks."""
    if tenants == "any" or not gpus:
        return
    others = list(others)
    for other in others:
        if other.namespace == namespace:
            continue
        met = sorted(gpus & gpus_shared_by(other, gpu_of))
        if met:
            where = ", ".join(f"gpu-{index}" for index in met)
            holders = [
                o.uid
                for o in others
                if o.namespace != namespace and set(met) & gpus_shared_by(o, gpu_of)
            ]
            # The message reaches the refused claim's namespace (its pod's Events): it names
            # no claim or namespace of the other tenant; the plugin's log does (preparer).
            raise TenantMixError(
                f"{where} serves the claims of another namespace; a shared GPU serves one "
                f"namespace at a time, so a claim of namespace {namespace!r} may use it only "
                "once those claims are gone, or if the administrator lets namespaces share "
                "GPUs (kubeletPlugin.sharedGpuTenants: any)",
                holders=holders,
            )


def tenants_by_gpu(
    records: Iterable[ClaimRecord], gpu_of: Callable[[str], int | None]
) -> dict[int, str]:
    """GPU index -> the namespace whose prepared (or half-prepared) claims share it, what the
    plugin publishes as the GPU's ``tenant``. A GPU that two namespaces hold (only where the
    administrator lets them share, or records of an older plugin) is given the first by
    name: the published value is a hint for the scheduler, prepare decides."""
    held: dict[int, set[str]] = {}
    for record in records:
        for index in gpus_shared_by(record, gpu_of):
            held.setdefault(index, set()).add(record.namespace)
    return {index: min(namespaces) for index, namespaces in held.items()}
