"""How a claim's devices are shared: time-slicing, MPS on whole GPUs and on MIG devices, and
MPS-enforced fractions of shared GPUs. Turns the claim's opaque configs and the scheduler's
grants into a plan the preparer carries out and records."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.config_resolution import ConfigResolutionError, resolve_configs
from flexgpu.driver.config_support import unsupported_on_device
from flexgpu.driver.gpu_model import GpuInfo, MpsDaemon, TimeSliceInterval
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.mps_limits import (
    ConfiguredDevice,
    PinnedLimitError,
    pinned_memory_limits,
    unmatched_keys,
)
from flexgpu.driver.opaque_config import (
    GpuConfig,
    MigConfig,
    MpsConfig,
    OpaqueConfigError,
    SharingStrategy,
)
from flexgpu.driver.quantity import Quantity
from flexgpu.driver.user_text import shorten
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

MIB = 1024 * 1024


class SharingError(ValueError):
    """The claim's sharing settings cannot be applied; the text names what and why."""


@dataclass(frozen=True)
class MpsClient:
    """Limits for the claim's processes on one GPU's MPS daemon."""

    gpu_index: int
    active_thread_percentage: int | None
    pinned_memory_mib: int | None


@dataclass(frozen=True)
class MigMps:
    """The claim's MIG devices shared with MPS: one daemon of the claim's own serves them.
    Its limits are worked out once the devices have UUIDs (``spec``): NVIDIA's per-device
    keys index the devices in UUID order, and a partition prepare creates gets its UUID
    only then."""

    devices: tuple[str, ...]  # device names, each once
    config: MpsConfig | None

    def spec(self, uuids: Mapping[str, str], parents: Mapping[str, int]) -> MigMpsDaemonSpec:
        """What the daemon is started with, given each device's UUID and parent GPU index.
        Raises ``PinnedLimitError`` as ``pinned_memory_limits`` does."""
        order = sorted(self.devices, key=lambda name: uuids[name])
        mps = self.config
        pinned: tuple[int | None, ...] = ()
        if mps is not None:
            limits = pinned_memory_limits(mps, [ConfiguredDevice(n, uuids[n]) for n in order])
            pinned = tuple(_mib(limits[name]) for name in order)
            if all(p is None for p in pinned):
                pinned = ()
        return MigMpsDaemonSpec(
            parent_index=parents[order[0]],
            device_uuids=tuple(uuids[name] for name in order),
            active_thread_percentage=mps.defaultActiveThreadPercentage if mps else None,
            pinned_memory_mib=pinned,
        )


@dataclass
class SharingPlan:
    time_slices: dict[int, TimeSliceInterval] = field(default_factory=dict)
    mps: MpsClient | None = None
    mig_mps: MigMps | None = None
    # Per device name: what was granted (memory MiB, compute %), for status and checks.
    shares: dict[str, dict[str, int]] = field(default_factory=dict)


def plan_sharing(
    claim: ClaimView, ours: Sequence[AllocatedDevice], devices: NodeDevices
) -> SharingPlan:
    try:
        resolved = resolve_configs(list(claim.configs), sorted({d.request for d in ours}))
    except (ConfigResolutionError, OpaqueConfigError) as err:
        raise SharingError(f"claim {_claim_name(claim)}: {err}") from None
    plan = SharingPlan()
    clients: list[MpsClient] = []
    # Whole GPUs under MPS, per config: NVIDIA's per-device keys index the config's devices.
    mps_groups: dict[int, list[tuple[GpuConfig, AllocatedDevice, GpuInfo]]] = {}
    # MIG devices under MPS, per config: each config would need a daemon of its own.
    mig_groups: dict[int, tuple[MigConfig, dict[str, None]]] = {}
    for allocated in ours:
        gpu = devices.gpu(allocated.device)
        if gpu is None:
            continue  # reported by the preparer as an unknown device
        kind = devices.device_type(allocated.device)
        try:
            config = resolved[allocated.request].for_device(kind, allocated.device)
        except ConfigResolutionError as err:
            raise SharingError(str(err)) from None
        reserved = _granted_compute(allocated) if kind == "shared" else None
        unsupported = unsupported_on_device(config, kind, allocated.request, reserved)
        if unsupported:
            # Worded as admission words it (driver.config_support), with the entry's place
            # in the allocation's config list.
            index = next(
                (e.index for e in resolved[allocated.request].candidates if e.config is config),
                None,
            )
            where = f"config[{index}].opaque.parameters" if index is not None else "parameters"
            problems = OpaqueConfigError(unsupported).render(where)
            raise SharingError(f"claim {_claim_name(claim)}: {'; '.join(problems)}")
        if isinstance(config, MigConfig):
            # Exclusive and TimeSlicing leave the device as it is (a MIG device has no
            # time-slice setting, and its parent's is not this claim's to change).
            if config.effective_sharing.strategy is SharingStrategy.MPS:
                _, names = mig_groups.setdefault(id(config), (config, {}))
                names[allocated.device] = None
            continue
        sharing = config.effective_sharing
        if kind == "shared":
            clients.append(_share_client(allocated, config, gpu.index, gpu.memory_mib, plan))
        elif sharing.strategy == SharingStrategy.TIME_SLICING:
            interval = (
                sharing.timeSlicingConfig.interval
                if sharing.timeSlicingConfig
                else TimeSliceInterval.DEFAULT
            )
            plan.time_slices[gpu.index] = TimeSliceInterval(interval)
        elif sharing.strategy == SharingStrategy.MPS:
            mps_groups.setdefault(id(config), []).append((config, allocated, gpu))
    for group in mps_groups.values():
        clients += _whole_gpu_clients(claim, group)
    gpus = sorted({c.gpu_index for c in clients})
    if len(gpus) + len(mig_groups) > 1:
        used = [", ".join(f"gpu-{i}" for i in gpus)] if gpus else []
        used += [f"MIG devices {', '.join(names)}" for _, names in mig_groups.values()]
        raise SharingError(
            f"claim {_claim_name(claim)} uses MPS on {' and on '.join(used)}; a container "
            "talks to one MPS daemon, so a claim's MPS devices must be served by one: one GPU "
            "per claim, or the claim's MIG devices under one config; split the claim, or use "
            "strategy Exclusive or TimeSlicing"
        )
    if clients:
        plan.mps = _merge(clients)
    for config, names in mig_groups.values():
        plan.mig_mps = _mig_mps(claim, config, tuple(names), devices)
    return plan


def _claim_name(claim: ClaimView) -> str:
    return shorten(f"{claim.namespace}/{claim.name}")


def _share_client(
    allocated: AllocatedDevice, config: GpuConfig, index: int, total_mib: int, plan: SharingPlan
) -> MpsClient:
    sharing = config.effective_sharing
    memory_mib = total_mib
    # Parsed with the claim: a malformed value already failed the prepare (ClaimResultError).
    granted = allocated.consumed_capacity or {}
    if "memory" in granted:
        memory_mib = granted["memory"].ceil() // MIB
    compute = _granted_compute(allocated)
    plan.shares[allocated.device] = {"memory_mib": memory_mib, "compute_percent": compute}
    mps = sharing.mpsConfig
    limit = config.share.computeLimit if config.share is not None else None
    if limit is not None:
        # Burstable: the scheduler counted the request, MPS enforces the limit (checked
        # above to be at least the request).
        threads = limit
    elif compute > 0:
        threads = compute
    elif mps is not None and mps.defaultActiveThreadPercentage is not None:
        threads = mps.defaultActiveThreadPercentage
    else:
        # No compute reserved: cap SMs in proportion to the memory granted.
        threads = max(1, math.ceil(memory_mib * 100 / total_mib))
    return MpsClient(index, min(threads, 100), memory_mib)


def _granted_compute(allocated: AllocatedDevice) -> int:
    granted = (allocated.consumed_capacity or {}).get("compute")
    return granted.ceil() if granted is not None else 0


def _whole_gpu_clients(
    claim: ClaimView, group: Sequence[tuple[GpuConfig, AllocatedDevice, GpuInfo]]
) -> list[MpsClient]:
    mps = group[0][0].effective_sharing.mpsConfig
    if mps is None:
        return [MpsClient(gpu.index, None, None) for _, _, gpu in group]
    devices = [ConfiguredDevice(a.device, gpu.uuid) for _, a, gpu in group]
    try:
        limits = pinned_memory_limits(mps, devices)
    except PinnedLimitError as err:
        raise SharingError(f"claim {_claim_name(claim)}: {err}") from None
    clients = []
    for _, allocated, gpu in group:
        limit = limits[allocated.device]
        pinned = limit.ceil() // MIB if limit is not None else None
        clients.append(MpsClient(gpu.index, mps.defaultActiveThreadPercentage, pinned))
    return clients


def _mig_mps(
    claim: ClaimView, config: MigConfig, names: tuple[str, ...], devices: NodeDevices
) -> MigMps:
    """The claim's MIG MPS devices, their per-device keys checked before anything is created:
    by index and name for a partition prepare creates (its UUID comes with it), by UUID too
    for a static one."""
    mps = config.effective_sharing.mpsConfig
    if mps is not None:
        known = {n: devices.resolve(n) for n in names}
        configured = [ConfiguredDevice(n, d.uuid if d else None) for n, d in known.items()]
        problems = unmatched_keys(mps, configured)
        if problems:
            text = "; ".join(p.render() for p in problems)
            raise SharingError(f"claim {_claim_name(claim)}: {text}")
    return MigMps(names, mps)


def _mib(limit: Quantity | None) -> int | None:
    return limit.ceil() // MIB if limit is not None else None


def _merge(clients: Sequence[MpsClient]) -> MpsClient:
    """Several requests of one claim on one GPU add up."""
    threads = [c.active_thread_percentage for c in clients]
    pinned = [c.pinned_memory_mib for c in clients]
    return MpsClient(
        clients[0].gpu_index,
        None if None in threads else min(100, sum(t for t in threads if t is not None)),
        None if None in pinned else sum(p for p in pinned if p is not None),
    )


def mps_env(daemon: MpsDaemon, client: MpsClient) -> dict[str, str]:
    # The pipe folder only: the daemon's log folder is never a client's (mps_mounts).
    env = {"CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir}
    if client.active_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(client.active_thread_percentage)
    if client.pinned_memory_mib is not None:
        # Ordinal 0: the daemon serves only this GPU, so it is the client's first device.
        # (Limits given by UUID are not applied by some drivers; ordinals are.)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={client.pinned_memory_mib}M"
    return env


def mig_mps_env(daemon: MpsDaemon, spec: MigMpsDaemonSpec) -> dict[str, str]:
    """What every device the daemon serves hands its container: the daemon's pipe folder and the
    claim's limits, as a whole GPU's client gets them. The limits are the daemon's defaults
    already; the client's own variables say the same, and keep it so if the daemon is
    started again without them. Ordinal ``i`` is ``spec.device_uuids[i]``: clients see the
    daemon's devices in that order."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir}
    if spec.active_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(spec.active_thread_percentage)
    pinned = [f"{i}={mib}M" for i, mib in enumerate(spec.pinned_memory_mib) if mib is not None]
    if pinned:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(pinned)
    return env


def mps_mounts(daemon: MpsDaemon) -> list[tuple[str, str]]:
    """What a client container mounts: the pipe folder (to reach the daemon) and the daemon's
    shared memory as ``/dev/shm``. Not the log folder: a client needs none, and the daemon's
    and servers' logs name every client of the GPU."""
    return [
        (daemon.pipe_dir, daemon.pipe_dir),
        (daemon.shm_dir, "/dev/shm"),
    ]
