"""Read-only check of the NVML backend on a real GPU machine.

Run from the repository root:  python tests/gpu/check_nvml_readonly.py [--json]

Prints the inventory NVML reports, the devices the driver would publish, and how NVML's MIG
profile figures compare with the simulated catalog for the same product. It never changes a GPU
setting: the backend is wrapped read-only, and below it NVML itself is wrapped so that only
query functions are reachable (no MIG mode change, instance creation, compute-mode or time-slice
change, or reset can be issued, even by mistake).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pynvml

from flexgpu.driver.backend_errors import BackendUnavailableError, GpuBackendError
from flexgpu.driver.gpu_catalog import spec_for_product_name
from flexgpu.driver.inventory import NodeInventory, collect_inventory
from flexgpu.driver.inventory_report import gpu_table, mig_table
from flexgpu.driver.names import mig_device_name
from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.driver.nvml_readonly import ReadOnlyNvml
from flexgpu.driver.readonly_backend import ReadOnlyBackend
from flexgpu.driver.resource_slice import render_node_gpus


def published_devices(inventory: NodeInventory) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = render_node_gpus([entry.gpu for entry in inventory.gpus])
    for entry in inventory.gpus:
        for profile in entry.mig_profiles:
            for placement in profile.placements:
                devices.append(
                    {
                        "name": mig_device_name(entry.gpu.index, profile.name, placement.start),
                        "profile": profile.name,
                        "placement": f"{placement.start}:{placement.size}",
                    }
                )
    return devices


def catalog_differences(inventory: NodeInventory) -> list[str]:
    """Where NVML's figures differ from the simulated catalog for the same product."""
    notes = []
    for entry in inventory.gpus:
        gpu = entry.gpu
        spec = spec_for_product_name(gpu.product_name)
        if spec is None:
            notes.append(f"gpu-{gpu.index}: {gpu.product_name!r} is not in the catalog")
            continue
        if spec.memory_mib != gpu.memory_mib:
            notes.append(f"gpu-{gpu.index}: memory {gpu.memory_mib} MiB, catalog {spec.memory_mib}")
        catalog = {p.profile_id: p for p in spec.mig_profiles}
        for profile in entry.mig_profiles:
            expected = catalog.get(profile.profile_id)
            if expected is None:
                notes.append(f"gpu-{gpu.index}: profile {profile.name} not in catalog")
            elif expected != profile:
                notes.append(f"gpu-{gpu.index}: {profile.name}: NVML {profile} catalog {expected}")
    return notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    try:
        backend = ReadOnlyBackend(NvmlBackend(nvml=ReadOnlyNvml(pynvml)))
    except BackendUnavailableError as exc:
        print(f"NVML is not available: {exc.message}", file=sys.stderr)
        return 2
    with backend:
        try:
            inventory = collect_inventory(backend)
            compute_modes = {
                e.gpu.index: str(backend.get_compute_mode(e.gpu.index)) for e in inventory.gpus
            }
            processes = {
                e.gpu.index: len(backend.process_samples(e.gpu.index)) for e in inventory.gpus
            }
        except GpuBackendError as exc:
            print(f"NVML query failed: {exc.message}", file=sys.stderr)
            return 1
    devices = published_devices(inventory)
    differences = catalog_differences(inventory)
    if args.json:
        document = {
            "inventory": inventory.model_dump(mode="json"),
            "computeModes": compute_modes,
            "processCounts": processes,
            "publishedDevices": devices,
            "catalogDifferences": differences,
        }
        print(json.dumps(document, indent=2))
        return 0
    print(gpu_table(inventory))
    print()
    print(mig_table(inventory))
    print()
    print(f"compute modes: {compute_modes}  running processes: {processes}")
    print(f"devices the driver would publish ({len(devices)}):")
    for device in devices:
        print(f"  {device['name']}")
    print("catalog differences:" if differences else "catalog matches NVML for these products")
    for note in differences:
        print(f"  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
