"""Sets a claim's sharing plan on its GPUs (time-slice, MPS daemon and limits) and tells
each of its devices what it runs under."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flexgpu.driver.cdi import CdiDevice
from flexgpu.driver.log_format import claim_fields
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.mps_limits import PinnedLimitError
from flexgpu.kubelet_plugin.claims.checkpoint_records import MpsShareRecord
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.mps_daemons import MpsDaemons
from flexgpu.kubelet_plugin.claims.prepare_records import mig_share_record
from flexgpu.kubelet_plugin.claims.sharing import SharingPlan, mig_mps_env, mps_env, mps_mounts
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

log = logging.getLogger(__name__)


class SharingSetupError(Exception):
    """The plan cannot be carried out; the text names the device or claim and why."""


def apply_sharing(
    node: NodeDevices,
    *,
    node_name: str,
    mps: MpsDaemons,
    claim: ClaimView,
    plan: SharingPlan,
    devices: list[CdiDevice],
) -> tuple[list[CdiDevice], MpsShareRecord | None]:
    """Sets what the plan says on the GPUs and hands each device its part: the time-slice
    it runs under (told to the workload and to a rebuild after a lost checkpoint), the MPS
    daemon's folders and the claim's limits. For MIG devices under MPS it also returns
    the completed share record: the daemon's UUIDs and limits, known only now."""
    backend = node.backend
    for index, interval in plan.time_slices.items():
        backend.set_time_slice(index, interval)
    env: dict[str, str] = {}
    mounts: list[tuple[str, str]] = []
    if plan.mps is not None:
        daemon = mps.start(plan.mps.gpu_index)
        env, mounts = mps_env(daemon, plan.mps), mps_mounts(daemon)
    mig_share = None
    served: set[str] = set()
    if plan.mig_mps is not None:
        spec = _mig_mps_spec(node, node_name, claim, plan, devices)
        daemon = mps.start_mig(spec)
        log.info(
            "MPS daemon %s started for %s",
            spec.key,
            ", ".join(plan.mig_mps.devices),
            extra=claim_fields(claim.namespace, claim.name, claim.uid),
        )
        env, mounts = mig_mps_env(daemon, spec), mps_mounts(daemon)
        served = set(plan.mig_mps.devices)
        mig_share = mig_share_record(plan.mig_mps.devices, spec, daemon)
    result = []
    for device in devices:
        gpu = node.gpu(device.device_name)
        where = gpu.index if gpu is not None else -1
        runs_under = plan.time_slices.get(where)
        on_mps = device.device_name in served or (
            plan.mps is not None and where == plan.mps.gpu_index
        )
        result.append(
            device.with_sharing(
                env if on_mps else {},
                mounts if on_mps else [],
                str(runs_under) if runs_under is not None else None,
            )
        )
    return result, mig_share


def _mig_mps_spec(
    node: NodeDevices,
    node_name: str,
    claim: ClaimView,
    plan: SharingPlan,
    devices: Sequence[CdiDevice],
) -> MigMpsDaemonSpec:
    assert plan.mig_mps is not None
    uuids = {d.device_name: d.uuid for d in devices}
    parents = {}
    for name in plan.mig_mps.devices:
        gpu = node.gpu(name)
        if gpu is None or name not in uuids:
            raise SharingSetupError(f"MIG device {name} is not on node {node_name}")
        parents[name] = gpu.index
    try:
        return plan.mig_mps.spec(uuids, parents)
    except PinnedLimitError as err:  # a UUID key checked only now the UUIDs are known
        raise SharingSetupError(f"claim {claim.namespace}/{claim.name}: {err}") from None
