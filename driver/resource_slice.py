"""Renders a node's GPU inventory into ResourceSlice content (``resource.k8s.io/v1``).

Pure: produces JSON-ready dicts in the API's shape; the kubelet plugin submits them. Device
order is allocation priority for the scheduler (first fit), so GPUs are published by index.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.names import (
    DRIVER_NAME,
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    TENANT_ATTRIBUTE,
    TENANT_READY_CONDITION,
    TENANT_TAKEN_CONDITION,
    gpu_device_name,
)

# API limits (resource.k8s.io/v1 validation).
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_LENGTH = 64
MAX_COUNTER_SETS_PER_SLICE = 8

# One entry of a ResourceSlice's spec.devices, as JSON (not driver.allocation.model.Device,
# the scheduler-side view of a published device).
SliceDevice = dict[str, Any]


def semver(version: str) -> str:
    """NVML versions to semantic versions: ``9.0`` -> ``9.0.0``, ``580.95.05`` -> ``580.95.5``.

    CEL's semver library rejects leading zeros and missing components, and these attributes
    are meant to be compared (``device.attributes[...].driverVersion.isGreaterThan(...)``).
    """
    parts = re.findall(r"\d+", version)
    if not parts:
        raise ValueError(f"version {version!r} has no numeric components")
    numbers = [str(int(p)) for p in parts[:3]]
    numbers += ["0"] * (3 - len(numbers))
    return ".".join(numbers)


def _string(value: str) -> dict[str, str]:
    # The API caps string values at 64 characters; product names never reach it, but a user's
    # topology file could, and a rejected slice would hide every device of the node.
    return {"string": value[:MAX_STRING_LENGTH]}


def gpu_identity_attributes(gpu: GpuInfo) -> dict[str, dict[str, Any]]:
    """Attributes every device carved from this GPU carries (whole GPU, MIG, share)."""
    attrs: dict[str, dict[str, Any]] = {
        "uuid": _string(gpu.uuid),
        "index": {"int": gpu.index},
        "productName": _string(gpu.product_name),
        "brand": _string(gpu.brand),
        "architecture": _string(gpu.architecture),
        "cudaComputeCapability": {"version": semver(gpu.cuda_compute_capability)},
        "driverVersion": {"version": semver(gpu.driver_version)},
        "cudaDriverVersion": {"version": semver(gpu.cuda_driver_version)},
        "migCapable": {"bool": gpu.mig_capable},
        "nvlinkDomain": _string(gpu.nvlink_domain),
        PCI_BUS_ID_ATTRIBUTE: _string(gpu.pci_bus_id),
    }
    if gpu.numa_node is not None:
        # Both: the standard name lets a claim align with CPU and NIC drivers' devices
        # (matchAttribute), the driver's own keeps existing selectors working.
        attrs["numaNode"] = {"int": gpu.numa_node}
        attrs[NUMA_NODE_ATTRIBUTE] = {"int": gpu.numa_node}
    if gpu.pcie_root is not None:
        attrs[PCIE_ROOT_ATTRIBUTE] = _string(gpu.pcie_root)
    return attrs


def whole_gpu_device(gpu: GpuInfo) -> SliceDevice:
    attrs = {"type": _string("gpu"), **gpu_identity_attributes(gpu)}
    capacity: dict[str, dict[str, str]] = {"memory": {"value": f"{gpu.memory_mib}Mi"}}
    if gpu.multiprocessors is not None:
        capacity["multiprocessors"] = {"value": str(gpu.multiprocessors)}
    return {"name": gpu_device_name(gpu.index), "attributes": attrs, "capacity": capacity}


# Shares are enforced with MPS pinned-memory limits; below 1 GiB a CUDA context alone does
# not fit, so smaller requests are rounded up to it.
MIN_SHARE_MEMORY = "1Gi"


def with_tenant(device: SliceDevice, tenant: str, *, binding_conditions: bool) -> SliceDevice:
    """A shared GPU as published with the namespace it serves ("" while free). A free one
    carries binding conditions where the cluster has them: the selector admission adds cannot
    keep two namespaces apart on a GPU that no claim holds yet (claims created at the same
    instant are all allocated before any tenant is published), so the plugin decides which
    namespace a free GPU goes to before any pod is bound (kubelet_plugin/claims/tenant_binding.py).
    A held GPU needs none: the selector already keeps other namespaces off it."""
    out: SliceDevice = {
        **device,
        "attributes": {**device["attributes"], TENANT_ATTRIBUTE: _string(tenant)},
    }
    if binding_conditions and not tenant:
        out["bindingConditions"] = [TENANT_READY_CONDITION]
        out["bindingFailureConditions"] = [TENANT_TAKEN_CONDITION]
    return out


def shared_gpu_device(gpu: GpuInfo) -> SliceDevice:
    """A GPU handed out in fractions: several claims each consume part of its ``memory`` and
    ``compute`` (percent of its SMs), and the scheduler packs them (consumable capacity).

    Request policies: ``memory`` defaults to the whole GPU, so a claim that asks for nothing
    gets the whole GPU as in the whole-GPU class; ``compute`` defaults to 0, so a claim that
    asks only for memory does not reserve SMs and blocks nobody; its MPS thread limit is then
    derived from its memory fraction. A claim that asks for ``compute`` reserves it.
    """
    memory = f"{gpu.memory_mib}Mi"
    attrs = {"type": _string("shared"), **gpu_identity_attributes(gpu)}
    capacity: dict[str, Any] = {}
    if gpu.multiprocessors is not None:
        # A capacity as on whole GPUs and MIG devices, so one CEL selector serves all; on a
        # shared device every capacity is consumable, so it may only be consumed as 0.
        capacity["multiprocessors"] = {
            "value": str(gpu.multiprocessors),
            "requestPolicy": {"default": "0", "validValues": ["0"]},
        }
    return {
        "name": gpu_device_name(gpu.index),
        "allowMultipleAllocations": True,
        "attributes": attrs,
        "capacity": capacity
        | {
            "memory": {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": MIN_SHARE_MEMORY, "max": memory},
                },
            },
            "compute": {
                "value": "100",
                "requestPolicy": {
                    "default": "0",
                    "validRange": {"min": "0", "max": "100", "step": "1"},
                },
            },
        },
    }


def render_node_gpus(gpus: Sequence[GpuInfo], shared: Collection[int] = ()) -> list[SliceDevice]:
    """Every healthy GPU in index order: shared ones (by index) as fractions, the rest whole.
    Unhealthy GPUs are left out so nothing new lands on them; prepared claims stay."""
    return [
        shared_gpu_device(g) if g.index in shared else whole_gpu_device(g)
        for g in sorted(gpus, key=lambda g: g.index)
        if g.health == "Healthy"
    ]


def check_device(device: SliceDevice) -> None:
    """Raises ValueError naming the device and limit when the API would reject it."""
    count = len(device.get("attributes", {})) + len(device.get("capacity", {}))
    if count > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(
            f"device {device['name']}: {count} attributes and capacities; "
            f"the API allows at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )


def _string_attribute(device: SliceDevice, name: str) -> str:
    value = device.get("attributes", {}).get(name, {})
    return str(value.get("string", "")) if isinstance(value, dict) else ""


# ``allocation_order``'s place for the whole-GPU devices of dynamic-MIG GPUs: behind this many
# MIG profiles (in publication order, smallest first). 0 puts them before every partition;
# WHOLE_GPUS_LAST (or any number at least the profile count) behind every partition.
WHOLE_GPUS_FIRST = 0
WHOLE_GPUS_LAST = 1 << 30


def allocation_order(
    devices: Sequence[SliceDevice], *, whole_after_profiles: int = WHOLE_GPUS_FIRST
) -> list[SliceDevice]:
    """Devices in the order the scheduler should try them (it takes the first that fits):
    devices without shared counters as given (whole and shared GPUs), then the whole GPUs of
    dynamic-MIG GPUs, then the partitions profile by profile, each profile GPU by GPU.
    ``whole_after_profiles`` moves the dynamic-MIG GPUs' whole-GPU devices behind that many
    profiles' partitions (docs/admin.md, "Scale", for what each place costs which claim).

    The scheduler runs the class and request selectors (CEL) on every free device it passes
    on each node it tries, and that is most of its cost; ordered GPU by GPU, a 1g claim on a
    busy node passes every other profile of every fuller GPU (about 19 devices per GPU on an
    H100), ordered profile by profile it passes only the whole GPUs and taken 1g partitions.
    Packing is unchanged: a profile still fills the first GPU with room, in each GPU's
    placement order (``driver.mig_devices.placement_order``). Profiles keep their first
    order (``dynamic_mig_devices`` lists them smallest first), and the order is stable."""
    if whole_after_profiles < 0:
        raise ValueError(f"whole_after_profiles {whole_after_profiles}: must be 0 or more")
    rank: dict[str, int] = {}
    for device in devices:
        if "consumesCounters" in device and _string_attribute(device, "type") == "mig":
            rank.setdefault(_string_attribute(device, "profile"), len(rank))
    whole_at = 2 * min(whole_after_profiles, len(rank))

    # Partitions of profile r sort at 2r+1, the whole GPUs at an even place between them.
    def key(device: SliceDevice) -> tuple[int, int]:
        if "consumesCounters" not in device:
            return (0, 0)
        if _string_attribute(device, "type") != "mig":
            return (1, whole_at)
        return (1, 2 * rank[_string_attribute(device, "profile")] + 1)

    return sorted(devices, key=key)


def chunk_devices(devices: Sequence[SliceDevice]) -> list[list[SliceDevice]]:
    """Splits devices into slice-sized groups; an empty pool is still one empty slice."""
    limit = MAX_DEVICES_PER_SLICE
    if any("consumesCounters" in d or "taints" in d for d in devices):
        limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
    if not devices:
        return [[]]
    return [list(devices[i : i + limit]) for i in range(0, len(devices), limit)]


def slice_specs(
    node_name: str,
    devices: Sequence[SliceDevice],
    generation: int,
    shared_counters: Sequence[dict[str, Any]] = (),
    *,
    counters_in_own_slice: bool = True,
    whole_after_profiles: int = WHOLE_GPUS_FIRST,
) -> list[dict[str, Any]]:
    """The ``spec`` of every slice in the node's pool, consistent in generation and count.

    Kubernetes 1.35+ wants shared counters in slices of their own (at most 8 counter sets
    each), placed first so the pool is complete in one pass. A 1.34 server wants each counter
    set in the same slice as the devices that consume it (``counters_in_own_slice=False``):
    then every counter set travels with its consumers and the other devices are chunked.
    ``whole_after_profiles`` is passed to ``allocation_order`` (1.35+ layout only).
    """
    for device in devices:
        check_device(device)
    pool = {"name": node_name, "generation": generation, "resourceSliceCount": 0}
    bodies: list[dict[str, Any]] = []
    if counters_in_own_slice:
        for i in range(0, len(shared_counters), MAX_COUNTER_SETS_PER_SLICE):
            bodies.append(
                {"sharedCounters": list(shared_counters[i : i + MAX_COUNTER_SETS_PER_SLICE])}
            )
        rest = allocation_order(devices, whole_after_profiles=whole_after_profiles)
    else:
        rest = []
        by_set: dict[str, list[SliceDevice]] = {c["name"]: [] for c in shared_counters}
        for device in devices:
            sets = [c["counterSet"] for c in device.get("consumesCounters", [])]
            if sets and sets[0] in by_set:
                by_set[sets[0]].append(device)
            else:
                rest.append(device)
        for counters in shared_counters:
            consumers = by_set[counters["name"]]
            if len(consumers) > MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS:
                raise ValueError(
                    f"counter set {counters['name']}: {len(consumers)} devices consume it; one "
                    f"slice holds at most {MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS}"
                )
            bodies.append({"sharedCounters": [counters], "devices": consumers})
    if rest or not bodies:
        bodies += [{"devices": group} for group in chunk_devices(rest)]
    pool["resourceSliceCount"] = len(bodies)
    return [
        {"driver": DRIVER_NAME, "nodeName": node_name, "pool": dict(pool), **body}
        for body in bodies
    ]
