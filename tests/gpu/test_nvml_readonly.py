"""Read-only check of the NVML backend on a real GPU machine.

As tests (marker ``gpu``; ``make test-gpu``, and ``make test`` / ``make test-unit`` with the
rest): they run only where NVIDIA's own ``libnvidia-ml.so.1`` loads and reports at least one
GPU, and are skipped with the reason everywhere else, including where the library found is
flexgpu's NVML mock (tools/nvml-mock; tests/nvml_library.py).

As a script, from the repository root:  python tests/gpu/test_nvml_readonly.py [--json]
It prints the inventory NVML reports, the devices the plugin would publish, and how NVML's MIG
profile figures compare with the simulated catalog for the same product.

It never changes a GPU setting: the backend is wrapped read-only, and below it NVML itself is
wrapped so that only query functions are reachable (no MIG mode change, instance creation,
compute-mode or time-slice change, or reset can be issued, even by mistake).

The tests read the GPU in a fresh interpreter (this file run as a script), never in the test
process: unit tests over the NVML mock load it under the same soname, and pynvml keeps the
first library it loaded, so NVIDIA's library loaded here would serve them, mutating calls
included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pynvml  # noqa: E402  (importing it loads no library; nvmlInit does)
import pytest  # noqa: E402

from flexgpu.driver.backend_errors import BackendUnavailableError, GpuBackendError  # noqa: E402
from flexgpu.driver.gpu_catalog import spec_for_product_name  # noqa: E402
from flexgpu.driver.gpu_model import ComputeMode, HealthState, MigProfile  # noqa: E402
from flexgpu.driver.inventory import NodeInventory, collect_inventory  # noqa: E402
from flexgpu.driver.inventory_report import gpu_table, mig_table  # noqa: E402
from flexgpu.driver.names import mig_device_name  # noqa: E402
from flexgpu.driver.nvml_backend import NvmlBackend  # noqa: E402
from flexgpu.driver.nvml_readonly import ReadOnlyNvml  # noqa: E402
from flexgpu.driver.readonly_backend import ReadOnlyBackend  # noqa: E402
from flexgpu.driver.resource_slice import check_device, render_node_gpus  # noqa: E402

pytestmark = pytest.mark.gpu

LIBRARY = "libnvidia-ml.so.1"
# Exported by flexgpu's NVML mock (tools/nvml-mock), never by NVIDIA's library.
MOCK_SYMBOL = "flexgpuMockInjectXid"


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


def real_gpu_problem() -> str | None:
    """Why NVIDIA's NVML cannot be read here (no library, the mock, no GPU), or None.

    Loads the library into this process: call it only in a process of its own (``--probe``).
    """
    try:
        library = ctypes.CDLL(LIBRARY)
    except OSError as err:
        return f"no {LIBRARY} to load (NVIDIA's kernel driver is not installed here): {err}"
    if hasattr(library, MOCK_SYMBOL):
        return f"the {LIBRARY} found is flexgpu's NVML mock (tools/nvml-mock), not NVIDIA's"
    nvml = ReadOnlyNvml(pynvml)
    try:
        nvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"NVIDIA's NVML does not start: {err}"
    try:
        count = int(nvml.nvmlDeviceGetCount())
    finally:
        nvml.nvmlShutdown()
    return None if count >= 1 else "NVIDIA's NVML reports no GPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="print why NVIDIA's NVML cannot be read here, or nothing, and exit 0",
    )
    args = parser.parse_args(argv)
    if args.probe:
        print(real_gpu_problem() or "")
        return 0
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
    print(f"devices the plugin would publish ({len(devices)}):")
    for device in devices:
        print(f"  {device['name']}")
    print("catalog differences:" if differences else "catalog matches NVML for these products")
    for note in differences:
        print(f"  {note}")
    return 0


# -- the tests -------------------------------------------------------------------------------


def _run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    """The script's JSON report from this machine's GPUs; skips where there are none."""
    probe = _run_script("--probe")
    assert probe.returncode == 0, probe.stderr
    problem = probe.stdout.strip()
    if problem:
        pytest.skip(f"needs a real GPU with NVIDIA's NVML: {problem}")
    run = _run_script("--json")
    assert run.returncode == 0, run.stderr
    document: dict[str, Any] = json.loads(run.stdout)
    return document


@pytest.fixture(scope="module")
def inventory(report: dict[str, Any]) -> NodeInventory:
    return NodeInventory.model_validate(report["inventory"])


def test_every_gpu_is_listed_with_its_identity(inventory: NodeInventory) -> None:
    gpus = [entry.gpu for entry in inventory.gpus]
    assert gpus, "NVML reported GPUs to the probe but the inventory lists none"
    assert [gpu.index for gpu in gpus] == list(range(len(gpus)))
    assert len({gpu.uuid for gpu in gpus}) == len(gpus)
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-"), gpu.uuid
        assert gpu.product_name and gpu.memory_mib > 0, gpu


def test_compute_modes_and_processes_are_read_for_every_gpu(
    report: dict[str, Any], inventory: NodeInventory
) -> None:
    indices = {str(entry.gpu.index) for entry in inventory.gpus}
    assert set(report["computeModes"]) == indices
    assert set(report["processCounts"]) == indices
    known = {str(mode) for mode in ComputeMode}
    assert set(report["computeModes"].values()) <= known, report["computeModes"]


def test_the_whole_gpus_render_as_devices_the_api_accepts(inventory: NodeInventory) -> None:
    gpus = [entry.gpu for entry in inventory.gpus]
    devices = render_node_gpus(gpus)
    healthy = [gpu.index for gpu in gpus if gpu.health == HealthState.HEALTHY]
    assert [device["name"] for device in devices] == [f"gpu-{index}" for index in healthy]
    for device in devices:
        check_device(device)


def _geometry(profile: MigProfile) -> tuple[object, ...]:
    return (
        profile.compute_slices,
        profile.memory_slices,
        profile.max_instances,
        profile.placements,
    )


def test_mig_geometry_is_the_catalogs(inventory: NodeInventory) -> None:
    """Slices and placements of each MIG profile NVML reports equal the simulated catalog's
    (node templates and the simulated backend rest on them); memory and SM figures may differ
    (docs/inventory.md) and are reported as warnings."""
    mismatches = []
    for entry in inventory.gpus:
        spec = spec_for_product_name(entry.gpu.product_name)
        if spec is None or not entry.mig_profiles:
            continue
        catalog = {p.profile_id: p for p in spec.mig_profiles}
        for profile in entry.mig_profiles:
            expected = catalog.get(profile.profile_id)
            if expected is None:
                mismatches.append(f"gpu-{entry.gpu.index}: profile {profile.name} not in catalog")
            elif _geometry(expected) != _geometry(profile):
                mismatches.append(
                    f"gpu-{entry.gpu.index}: {profile.name}: NVML {_geometry(profile)} "
                    f"catalog {_geometry(expected)}"
                )
    assert mismatches == []
    for note in catalog_differences(inventory):
        warnings.warn(f"catalog figures differ from NVML: {note}", stacklevel=1)


if __name__ == "__main__":
    sys.exit(main())
