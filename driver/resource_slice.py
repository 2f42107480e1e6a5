"""Renders a node's GPU inventory into ResourceSlice content (``resource.k8s.io/v1``).

Pure: produces JSON-ready dicts in the API's shape; the kubelet plugin submits them. Device
order is allocation priority for the scheduler (first fit), so GPUs are published by index.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from driver.gpu_model import GpuInfo
from driver.names import (
    DRIVER_NAME,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    gpu_device_name,
)

# API limits (resource.k8s.io/v1 validation).
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_LENGTH = 64

Device = dict[str, Any]


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
        attrs["numaNode"] = {"int": gpu.numa_node}
    if gpu.pcie_root is not None:
        attrs[PCIE_ROOT_ATTRIBUTE] = _string(gpu.pcie_root)
    return attrs


def whole_gpu_device(gpu: GpuInfo) -> Device:
    attrs = {"type": _string("gpu"), **gpu_identity_attributes(gpu)}
    capacity: dict[str, dict[str, str]] = {"memory": {"value": f"{gpu.memory_mib}Mi"}}
    if gpu.multiprocessors is not None:
        capacity["multiprocessors"] = {"value": str(gpu.multiprocessors)}
    return {"name": gpu_device_name(gpu.index), "attributes": attrs, "capacity": capacity}


def render_whole_gpus(gpus: Sequence[GpuInfo]) -> list[Device]:
    """One device per healthy GPU, in index order. Unhealthy GPUs are left out so nothing new
    is scheduled onto them; their prepared claims stay prepared."""
    return [
        whole_gpu_device(g) for g in sorted(gpus, key=lambda g: g.index) if g.health == "Healthy"
    ]


def check_device(device: Device) -> None:
    """Raises ValueError naming the device and limit when the API would reject it."""
    count = len(device.get("attributes", {})) + len(device.get("capacity", {}))
    if count > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(
            f"device {device['name']}: {count} attributes and capacities; "
            f"the API allows at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )


def chunk_devices(devices: Sequence[Device]) -> list[list[Device]]:
    """Splits devices into slice-sized groups; an empty pool is still one empty slice."""
    limit = MAX_DEVICES_PER_SLICE
    if any("consumesCounters" in d or "taints" in d for d in devices):
        limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
    if not devices:
        return [[]]
    return [list(devices[i : i + limit]) for i in range(0, len(devices), limit)]


def slice_specs(
    node_name: str,
    devices: Sequence[Device],
    generation: int,
    shared_counters: Sequence[dict[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The ``spec`` of every slice in the node's pool, consistent in generation and count.

    Shared counters go into a slice of their own (required from Kubernetes 1.35 on, accepted
    before), placed first so the pool is complete in one pass.
    """
    for device in devices:
        check_device(device)
    groups = chunk_devices(devices)
    specs: list[dict[str, Any]] = []
    count = len(groups) + (1 if shared_counters else 0)
    pool = {"name": node_name, "generation": generation, "resourceSliceCount": count}
    if shared_counters:
        specs.append(
            {
                "driver": DRIVER_NAME,
                "nodeName": node_name,
                "pool": dict(pool),
                "sharedCounters": list(shared_counters),
            }
        )
    for group in groups:
        specs.append(
            {"driver": DRIVER_NAME, "nodeName": node_name, "pool": dict(pool), "devices": group}
        )
    return specs
