"""The same GPU node published several ways, as ResourceSlice specs for hollow nodes (no plugin
process): flexgpu's own publication (the plugin's ``NodeDevices`` over a simulated HGX H100
node, chunked by ``slice_specs``), the same with the dynamic-MIG GPUs' whole-GPU devices in
another place of the device order (``FLEXGPU_ORDERS``) or with the partitions placement by
placement across the GPUs (``PLACEMENT_MAJOR``), the NVIDIA-style publication of the same
hardware, and whole GPUs only.

NVIDIA-style follows NVIDIA's k8s-dra-driver-gpu in DynamicMIG mode (cmd/gpu-kubelet-plugin:
partitions.go, mig.go, driver.go), written from its behaviour, not its code:
- every profile x placement of a dynamic-MIG GPU is a device named
  ``gpu-<minor>-mig-<profile without dots>-<profile id>-<start>``, beside the full GPU
  ``gpu-<minor>``;
- one counter set per GPU with one counter per capacity (multiprocessors, copy/decoder/encoder/
  jpeg/ofa engines, memory in bytes; the full GPU's are the largest profile's) plus one per
  memory slice; a partition consumes its capacities and its memory slices, the full GPU all;
- devices of a GPU in name order; one slice holding every counter set, then one slice per GPU
  in PCI bus order.
Devices keep flexgpu's attributes so the same DeviceClasses and claims select them; shared and
plain whole GPUs are published as flexgpu publishes them (NVIDIA-style only changes MIG).
tests/integration/test_nvidia_differential.py checks the devices, capacities, counter
consumption and counter sets against what NVIDIA's plugin v0.4.1 itself publishes.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexgpu.driver.gpu_model import GpuInfo, MigProfile
from flexgpu.driver.mig_catalog import MEMORY_SLICES
from flexgpu.driver.mig_devices import mig_attributes
from flexgpu.driver.names import DRIVER_NAME, mig_device_name
from flexgpu.driver.resource_slice import (
    WHOLE_GPUS_LAST,
    SliceDevice,
    shared_gpu_device,
    slice_specs,
    whole_gpu_device,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology, with_mig_off
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

TOPOLOGY = "hgx-h100-8"
DYNAMIC = frozenset({0, 1, 2, 3})
SHARED = frozenset({4, 5})
WHOLE = frozenset({6, 7})
# flexgpu's publication with the dynamic-MIG GPUs' whole-GPU devices behind this many MIG
# profiles (``allocation_order``'s ``whole_after_profiles``); "flexgpu" is the plugin's default.
FLEXGPU_ORDERS: dict[str, int | None] = {
    "flexgpu": None,
    "flexgpu-whole-after-1g": 1,
    "flexgpu-whole-last": WHOLE_GPUS_LAST,
}
# Each profile's partitions placement by placement across the GPUs (every GPU's first
# placement, then every GPU's second...) and the whole GPUs behind the 1g partitions: of the
# orders that keep the plain and shared GPUs first, the one whose 1g claims pass the fewest
# devices on the benchmark's loaded node. First fit then spreads small partitions over every
# GPU instead of filling one, so it is measured for its scheduling cost only.
PLACEMENT_MAJOR = "flexgpu-placement-major"
PUBLICATIONS = (*FLEXGPU_ORDERS, PLACEMENT_MAJOR, "nvidia-style", "whole-only")


@dataclass
class NodeInventory:
    """What one hollow node has: its GPUs, each GPU's MIG profiles and the GPUs in each mode."""

    gpus: list[GpuInfo]
    profiles: list[MigProfile]
    devices: NodeDevices
    dynamic: frozenset[int] = DYNAMIC
    shared: frozenset[int] = SHARED


def inventory(
    node: str, folder: Path, dynamic: frozenset[int] = DYNAMIC, shared: frozenset[int] = SHARED
) -> NodeInventory:
    # The H100 machine as it ships, MIG off everywhere: the publications compared are the
    # plugin's modes (whole, on-demand MIG), not GPUs someone partitioned beforehand.
    topology = with_mig_off(load_topology(TOPOLOGY))
    backend = SimulatedBackend(topology, node, state_path=folder / f"{node}.json")
    devices = NodeDevices(backend, shared=shared, dynamic_mig=dynamic)
    gpus = sorted(devices.gpus(), key=lambda g: g.index)
    return NodeInventory(gpus, devices.mig_profiles(min(dynamic)), devices, dynamic, shared)


def _rfc1123(name: str) -> str:
    return re.sub(r"[^a-z0-9-.]", "-", name.lower()).strip("-").removesuffix(".")


def nvidia_mig_name(gpu: int, profile: MigProfile, start: int) -> str:
    return f"gpu-{gpu}-mig-{_rfc1123(profile.name.replace('.', ''))}-{profile.profile_id}-{start}"


def _nvidia_capacities(profile: MigProfile) -> dict[str, int]:
    e = profile.engines
    return {
        "multiprocessors": profile.multiprocessors,
        "copyEngines": e.copy_engines,
        "decoders": e.decoders,
        "encoders": e.encoders,
        "jpegEngines": e.jpeg_decoders,
        "ofaEngines": e.ofa,
        "memory": profile.memory_mib * 1024 * 1024,
    }


def _counter_name(capacity: str) -> str:
    return _rfc1123(re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", capacity))


def _nvidia_counters(capacities: dict[str, int], start: int, size: int) -> dict[str, Any]:
    counters = {_counter_name(k): {"value": str(v)} for k, v in capacities.items()}
    counters.update({f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)})
    return counters


def nvidia_gpu(gpu: GpuInfo, profiles: Sequence[MigProfile]) -> tuple[list[SliceDevice], Any]:
    """A dynamic-MIG GPU's devices (in name order) and its counter set, NVIDIA-style."""
    most: dict[str, int] = {}
    for profile in profiles:
        for name, value in _nvidia_capacities(profile).items():
            most[name] = max(most.get(name, 0), value)
    set_name = f"gpu-{gpu.index}-counter-set"
    whole = whole_gpu_device(gpu)
    whole["capacity"] = {k: {"value": str(v)} for k, v in most.items()}
    whole["consumesCounters"] = [
        {"counterSet": set_name, "counters": _nvidia_counters(most, 0, MEMORY_SLICES)}
    ]
    devices = [whole]
    for profile in profiles:
        capacities = _nvidia_capacities(profile)
        for placement in profile.placements:
            devices.append(
                {
                    "name": nvidia_mig_name(gpu.index, profile, placement.start),
                    "attributes": mig_attributes(gpu, profile, placement),
                    "capacity": {k: {"value": str(v)} for k, v in capacities.items()},
                    "consumesCounters": [
                        {
                            "counterSet": set_name,
                            "counters": _nvidia_counters(
                                capacities, placement.start, placement.size
                            ),
                        }
                    ],
                }
            )
    devices.sort(key=lambda d: str(d["name"]))
    counters = {"name": set_name, "counters": _nvidia_counters(most, 0, MEMORY_SLICES)}
    return devices, counters


def _spec(node: str, body: dict[str, Any], count: int) -> dict[str, Any]:
    pool = {"name": node, "generation": 1, "resourceSliceCount": count}
    return {"driver": DRIVER_NAME, "nodeName": node, "pool": pool, **body}


def nvidia_specs(node: str, inv: NodeInventory) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    counter_sets = []
    for gpu in sorted(inv.gpus, key=lambda g: g.pci_bus_id):
        if gpu.index in inv.dynamic:
            devices, counters = nvidia_gpu(gpu, inv.profiles)
            counter_sets.append(counters)
        elif gpu.index in inv.shared:
            devices = [shared_gpu_device(gpu)]
        else:
            devices = [whole_gpu_device(gpu)]
        bodies.append({"devices": devices})
    bodies.insert(0, {"sharedCounters": counter_sets})
    return [_spec(node, body, len(bodies)) for body in bodies]


def flexgpu_specs(
    node: str, inv: NodeInventory, whole_after_profiles: int | None = None
) -> list[dict[str, Any]]:
    """What the plugin publishes for this node (Kubernetes 1.35+ slice layout), by default in
    the plugin's own device order."""
    devices, counters = inv.devices.slice_devices(), inv.devices.counter_sets()
    if whole_after_profiles is None:
        return slice_specs(node, devices, 1, counters)
    return slice_specs(node, devices, 1, counters, whole_after_profiles=whole_after_profiles)


def placement_major_specs(node: str, inv: NodeInventory) -> list[dict[str, Any]]:
    """``PLACEMENT_MAJOR``: the plugin's devices re-ordered, then rendered by ``slice_specs``,
    whose ``allocation_order`` groups by profile with a stable sort, so within a profile the
    order given here stands."""
    seen: dict[tuple[str, str], int] = {}

    def rank(device: SliceDevice) -> int:
        attrs = device.get("attributes", {})
        if attrs.get("type", {}).get("string") != "mig":
            return -1
        key = (str(attrs["profile"]["string"]), str(attrs["parentUUID"]["string"]))
        seen[key] = seen.get(key, -1) + 1  # devices come GPU by GPU, in placement order
        return seen[key]

    devices = inv.devices.slice_devices()
    ranks = [rank(d) for d in devices]
    ordered = [d for _, d in sorted(zip(ranks, devices, strict=True), key=lambda rd: rd[0])]
    return slice_specs(node, ordered, 1, inv.devices.counter_sets(), whole_after_profiles=1)


def whole_only_specs(node: str, inv: NodeInventory) -> list[dict[str, Any]]:
    return slice_specs(node, [whole_gpu_device(g) for g in inv.gpus], 1)


def node_specs(publication: str, node: str, inv: NodeInventory) -> list[dict[str, Any]]:
    if publication in FLEXGPU_ORDERS:
        return flexgpu_specs(node, inv, FLEXGPU_ORDERS[publication])
    if publication == PLACEMENT_MAJOR:
        return placement_major_specs(node, inv)
    if publication == "nvidia-style":
        return nvidia_specs(node, inv)
    if publication == "whole-only":
        return whole_only_specs(node, inv)
    raise ValueError(f"publication {publication!r}: expected one of {', '.join(PUBLICATIONS)}")


def mig_device(publication: str, gpu: int, profile: MigProfile, start: int) -> str:
    """The device name a partition has in a publication."""
    if publication == "nvidia-style":
        return nvidia_mig_name(gpu, profile, start)
    return mig_device_name(gpu, profile.name, start)


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="fg-scale-"))
