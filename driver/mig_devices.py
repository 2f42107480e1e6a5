"""MIG devices as published in ResourceSlices.

Dynamic MIG: every profile x placement of a GPU is a partitionable device that consumes
counters from the GPU's counter set, so the scheduler itself never hands out overlapping
partitions or more instances than the GPU allows. The whole GPU consumes every memory slice,
so it is only free while no partition is, and the other way round.

Counter layout: one counter per memory slice always; the compute-slice counter and a
profile's instance counter only where they bind, i.e. where memory-disjoint placements alone
would allow more compute slices or more instances than the GPU has (on the 8-slice GPUs this
leaves only the media-extension profiles' limit of one). The scheduler checks every counter of
every counter set in the pool for each candidate device, so counters that can never be the
limit cost scheduling time and slice bytes for nothing (docs/admin.md, "Scale").

Device order is the scheduler's first-fit order. Partitions smaller than half the GPU are
published from the top slice down and the larger ones from slice 0 up, so small partitions
gather at the top and leave the bottom half whole for the 3g/4g profiles (4g can only start
at slice 0) and for the whole GPU; measured with ``python -m bench.packing_churn``.

Static MIG: the instances a layout created are published as they are, without counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flexgpu.driver.gpu_model import GpuInfo, MigDevice, MigPlacement, MigProfile
from flexgpu.driver.mig_catalog import COMPUTE_SLICES, MEMORY_SLICES
from flexgpu.driver.names import (
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
    gpu_device_name,
    mig_device_name,
)
from flexgpu.driver.resource_slice import SliceDevice, gpu_identity_attributes, whole_gpu_device

COMPUTE_COUNTER = "compute-slices"


def counter_set_name(gpu_index: int) -> str:
    return gpu_device_name(gpu_index)


def memory_counter(slice_index: int) -> str:
    return f"memory-slice-{slice_index}"


def profile_counter(profile_id: int) -> str:
    return f"profile-{profile_id}-instances"


@dataclass(frozen=True)
class MigPartition:
    """What a MIG device name stands for: where to create it, or which instance it is."""

    parent_index: int
    profile_id: int
    profile_name: str
    placement: MigPlacement


def _most(placements: Sequence[tuple[int, MigPlacement]]) -> int:
    """The largest sum of values over memory-disjoint placements (interval scheduling: the
    best from slice ``i`` up either skips slice ``i`` or takes a placement starting there)."""
    ends = max((pl.end for _, pl in placements), default=0)
    best = [0] * (ends + 1)
    for start in range(ends - 1, -1, -1):
        best[start] = max(
            [best[start + 1]]
            + [value + best[pl.end] for value, pl in placements if pl.start == start]
        )
    return best[0]


def compute_counter_binds(profiles: Sequence[MigProfile]) -> bool:
    """True when memory-disjoint partitions could together need more compute slices than the
    GPU has, so the compute counter must be published to stop the scheduler."""
    everything = [(p.compute_slices, pl) for p in profiles for pl in p.placements]
    return _most(everything) > COMPUTE_SLICES


def instance_counter_binds(profile: MigProfile) -> bool:
    """True when the profile's placements alone allow more instances than NVML does."""
    return _most([(1, pl) for pl in profile.placements]) > profile.max_instances


def counter_set(gpu: GpuInfo, profiles: Sequence[MigProfile]) -> dict[str, Any]:
    counters: dict[str, dict[str, str]] = {
        memory_counter(i): {"value": "1"} for i in range(MEMORY_SLICES)
    }
    if compute_counter_binds(profiles):
        counters[COMPUTE_COUNTER] = {"value": str(COMPUTE_SLICES)}
    for profile in profiles:
        if instance_counter_binds(profile):
            counters[profile_counter(profile.profile_id)] = {"value": str(profile.max_instances)}
    return {"name": counter_set_name(gpu.index), "counters": counters}


def placement_order(profile: MigProfile) -> list[MigPlacement]:
    """First-fit order of a profile's placements: partitions under half the GPU from the top
    slice down, the rest from slice 0 up (see the module docstring)."""
    small = 2 * profile.memory_slices < MEMORY_SLICES
    return sorted(profile.placements, key=lambda p: -p.start if small else p.start)


def _consumes(gpu_index: int, counters: dict[str, int]) -> list[dict[str, Any]]:
    return [
        {
            "counterSet": counter_set_name(gpu_index),
            "counters": {name: {"value": str(v)} for name, v in counters.items()},
        }
    ]


def mig_attributes(gpu: GpuInfo, profile: MigProfile, placement: MigPlacement) -> dict[str, Any]:
    identity = gpu_identity_attributes(gpu)
    parent_uuid = identity.pop("uuid")
    parent_index = identity.pop("index")
    return {
        "type": {"string": "mig"},
        "profile": {"string": profile.name},
        "parentUUID": parent_uuid,
        "parentIndex": parent_index,
        "placementStart": {"int": placement.start},
        "placementSize": {"int": placement.size},
        **identity,
    }


def _mig_capacity(profile: MigProfile) -> dict[str, dict[str, str]]:
    engines = profile.engines
    return {
        "memory": {"value": f"{profile.memory_mib}Mi"},
        "multiprocessors": {"value": str(profile.multiprocessors)},
        "copyEngines": {"value": str(engines.copy_engines)},
        "decoders": {"value": str(engines.decoders)},
        "encoders": {"value": str(engines.encoders)},
        "jpegDecoders": {"value": str(engines.jpeg_decoders)},
        "ofa": {"value": str(engines.ofa)},
    }


def dynamic_mig_devices(
    gpu: GpuInfo, profiles: Sequence[MigProfile]
) -> tuple[list[SliceDevice], dict[str, MigPartition]]:
    """The GPU's partitionable devices (whole GPU first, then every placement of every
    profile, smallest profiles first, each profile's placements in ``placement_order``) and
    what each partition's name stands for."""
    full = max(profiles, key=lambda p: p.memory_slices)
    compute = compute_counter_binds(profiles)
    limited = {p.profile_id for p in profiles if instance_counter_binds(p)}
    whole_counters = {memory_counter(i): 1 for i in range(MEMORY_SLICES)}
    if compute:
        whole_counters[COMPUTE_COUNTER] = COMPUTE_SLICES
    if full.profile_id in limited:
        whole_counters[profile_counter(full.profile_id)] = 1
    whole = whole_gpu_device(gpu)
    whole["consumesCounters"] = _consumes(gpu.index, whole_counters)
    devices = [whole]
    # The whole GPU is the GPU itself (GPU UUID, NVLink peers), with MIG mode off: the
    # plugin switches MIG mode per claim where that needs no reset (node_devices.py), and
    # leaves this device out of the slice where it would.
    partitions: dict[str, MigPartition] = {}
    ordered = sorted(profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.profile_id))
    for profile in ordered:
        for placement in placement_order(profile):
            name = mig_device_name(gpu.index, profile.name, placement.start)
            counters = {memory_counter(i): 1 for i in range(placement.start, placement.end)}
            if compute:
                counters[COMPUTE_COUNTER] = profile.compute_slices
            if profile.profile_id in limited:
                counters[profile_counter(profile.profile_id)] = 1
            devices.append(
                {
                    "name": name,
                    "attributes": mig_attributes(gpu, profile, placement),
                    "capacity": _mig_capacity(profile),
                    "consumesCounters": _consumes(gpu.index, counters),
                }
            )
            partitions[name] = MigPartition(gpu.index, profile.profile_id, profile.name, placement)
    return devices, partitions


def static_mig_devices(
    gpu: GpuInfo, profiles: Sequence[MigProfile], instances: Sequence[MigDevice]
) -> tuple[list[SliceDevice], dict[str, MigPartition]]:
    """The instances that exist on a GPU with a static layout, by placement."""
    by_id = {p.profile_id: p for p in profiles}
    devices: list[SliceDevice] = []
    partitions: dict[str, MigPartition] = {}
    for instance in sorted(instances, key=lambda i: i.placement.start):
        profile = by_id.get(instance.profile_id)
        if profile is None or instance.uuid is None:
            continue  # half-made or unknown: not usable by CUDA
        name = mig_device_name(gpu.index, profile.name, instance.placement.start)
        attributes = mig_attributes(gpu, profile, instance.placement)
        attributes["uuid"] = {"string": instance.uuid}
        devices.append({"name": name, "attributes": attributes, "capacity": _mig_capacity(profile)})
        partitions[name] = MigPartition(
            gpu.index, profile.profile_id, profile.name, instance.placement
        )
    return devices, partitions


def with_binding_conditions(device: SliceDevice) -> SliceDevice:
    """An on-demand partition as published where binding conditions are on (Kubernetes
    1.36+): the scheduler binds its pod once the plugin has made it (PartitionReady) and
    schedules the pod again when making it failed (PartitionFailed)."""
    return {
        **device,
        "bindingConditions": [PARTITION_READY_CONDITION],
        "bindingFailureConditions": [PARTITION_FAILED_CONDITION],
        "bindsToNode": True,
    }
