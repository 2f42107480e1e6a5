"""How a claim's devices are shared: time-slicing, MPS on whole GPUs, and MPS-enforced
fractions of shared GPUs. Turns the claim's opaque configs and the scheduler's grants into a
plan the preparer carries out and records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.config_resolution import ConfigResolutionError, resolve_configs
from flexgpu.driver.config_support import unsupported_on_device
from flexgpu.driver.gpu_model import GpuInfo, MpsDaemon, TimeSliceInterval
from flexgpu.driver.mps_limits import ConfiguredDevice, PinnedLimitError, pinned_memory_limits
from flexgpu.driver.opaque_config import GpuConfig, MigConfig, OpaqueConfigError, SharingStrategy
from flexgpu.driver.user_text import shorten
from flexgpu.kubelet_plugin.claim_source import ClaimView
from flexgpu.kubelet_plugin.node_devices import NodeDevices

MIB = 1024 * 1024


class SharingError(ValueError):
    """The claim's sharing settings cannot be applied; the text names what and why."""


@dataclass(frozen=True)
class MpsClient:
    """Limits for the claim's processes on one GPU's MPS daemon."""

    gpu_index: int
    active_thread_percentage: int | None
    pinned_memory_mib: int | None


@dataclass
class SharingPlan:
    time_slices: dict[int, TimeSliceInterval] = field(default_factory=dict)
    mps: MpsClient | None = None
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
    for allocated in ours:
        gpu = devices.gpu(allocated.device)
        if gpu is None:
            continue  # reported by the preparer as an unknown device
        kind = devices.device_type(allocated.device)
        try:
            config = resolved[allocated.request].for_device(kind, allocated.device)
        except ConfigResolutionError as err:
            raise SharingError(str(err)) from None
        unsupported = unsupported_on_device(config, kind, allocated.request)
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
            # time-slice setting); MPS was refused by resolve_configs (driver.config_support),
            # exactly as admission refuses it.
            continue
        sharing = config.effective_sharing
        _check_multi_user(claim, config, gpu)
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
    if len(gpus) > 1:
        names = ", ".join(f"gpu-{i}" for i in gpus)
        raise SharingError(
            f"claim {_claim_name(claim)} uses MPS on {names}; a container talks to "
            "one MPS daemon, so MPS sharing serves one GPU per claim: request one GPU per "
            "claim, or use strategy Exclusive or TimeSlicing"
        )
    if clients:
        plan.mps = _merge(clients)
    return plan


def _claim_name(claim: ClaimView) -> str:
    return shorten(f"{claim.namespace}/{claim.name}")


def _share_client(
    allocated: AllocatedDevice, config: GpuConfig, index: int, total_mib: int, plan: SharingPlan
) -> MpsClient:
    sharing = config.effective_sharing
    memory_mib = total_mib
    compute = 0
    # Parsed with the claim: a malformed value already failed the prepare (ClaimResultError).
    granted = allocated.consumed_capacity or {}
    if "memory" in granted:
        memory_mib = granted["memory"].ceil() // MIB
    if "compute" in granted:
        compute = granted["compute"].ceil()
    plan.shares[allocated.device] = {"memory_mib": memory_mib, "compute_percent": compute}
    mps = sharing.mpsConfig
    if compute > 0:
        threads = compute
    elif mps is not None and mps.defaultActiveThreadPercentage is not None:
        threads = mps.defaultActiveThreadPercentage
    else:
        # No compute reserved: cap SMs in proportion to the memory granted.
        threads = max(1, math.ceil(memory_mib * 100 / total_mib))
    return MpsClient(index, min(threads, 100), memory_mib)


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


def _check_multi_user(claim: ClaimView, config: GpuConfig, gpu: GpuInfo) -> None:
    # As NVIDIA's driver: multi-user MPS needs Volta (compute capability 7.0) or newer.
    mps = config.effective_sharing.mpsConfig
    if mps is None or not mps.multiUser:
        return
    major = gpu.cuda_compute_capability.split(".", 1)[0]
    if not major.isdigit() or int(major) < 7:
        raise SharingError(
            f"claim {_claim_name(claim)}: sharing.mpsConfig.multiUser: true is not supported "
            f"on gpu-{gpu.index} (compute capability {gpu.cuda_compute_capability}); "
            "allowed: false, or a GPU of compute capability 7.0 or newer"
        )


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
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
        "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir,
    }
    if client.active_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(client.active_thread_percentage)
    if client.pinned_memory_mib is not None:
        # Ordinal 0: the daemon serves only this GPU, so it is the client's first device.
        # (Limits given by UUID are not applied by some drivers; ordinals are.)
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={client.pinned_memory_mib}M"
    return env


def mps_mounts(daemon: MpsDaemon) -> list[tuple[str, str]]:
    return [
        (daemon.pipe_dir, daemon.pipe_dir),
        (daemon.log_dir, daemon.log_dir),
        (daemon.shm_dir, "/dev/shm"),
    ]
