"""One selector serves every kind of device: ``multiprocessors`` is a capacity on whole GPUs,
shared GPUs and MIG devices (on a shared GPU one that can only be consumed as 0), and the
standard ``resource.kubernetes.io/numaNode`` sits beside the driver's own ``numaNode``, so a
claim can align a GPU with CPU and NIC drivers' devices."""

from __future__ import annotations

from typing import Any

import pytest

from flexgpu.driver.allocation.cel import device_activation, evaluate
from flexgpu.driver.allocation.model import parse_device, parse_slice
from flexgpu.driver.allocation.summary import capacity_summary
from flexgpu.driver.gpu_model import GpuInfo, MigMode
from flexgpu.driver.mig_catalog import mig_profiles_for
from flexgpu.driver.mig_devices import dynamic_mig_devices
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import shared_gpu_device, whole_gpu_device

CAP = f'device.capacity["{DRIVER_NAME}"]'
STANDARD = 'device.attributes["resource.kubernetes.io"].numaNode'


def gpu(numa: int | None = 1) -> GpuInfo:
    return GpuInfo.model_validate(
        {
            "index": 0,
            "uuid": "GPU-00000000-0000-0000-0000-000000000000",
            "product_name": "NVIDIA H100 80GB HBM3",
            "brand": "Nvidia",
            "architecture": "Hopper",
            "cuda_compute_capability": "9.0",
            "driver_version": "580.95.05",
            "cuda_driver_version": "13.0",
            "memory_mib": 81559,
            "multiprocessors": 132,
            "pci_bus_id": "0000:18:00.0",
            "pcie_root": "pci0000:15",
            "numa_node": numa,
            "nvlink_domain": "nvl-abc",
            "mig_capable": True,
            "mig_mode": MigMode(current=False, pending=False),
        }
    )


def devices() -> dict[str, dict[str, Any]]:
    migs, _ = dynamic_mig_devices(gpu(), list(mig_profiles_for("H100-80GB")))
    small = next(d for d in migs if d["name"].startswith("gpu-0-mig-1g"))
    return {"whole": whole_gpu_device(gpu()), "shared": shared_gpu_device(gpu()), "mig": small}


@pytest.mark.parametrize("kind", ["whole", "shared", "mig"])
def test_one_selector_reads_multiprocessors_and_the_standard_numa_node(kind: str) -> None:
    device = parse_device(devices()[kind])
    activation = device_activation(DRIVER_NAME, device)
    assert evaluate(f'{CAP}.multiprocessors.compareTo(quantity("16")) >= 0', activation)
    assert evaluate(f"{STANDARD} == 1", activation)
    assert evaluate(f'device.attributes["{DRIVER_NAME}"].numaNode == 1', activation)


def test_without_a_numa_node_neither_attribute_is_published() -> None:
    attributes = whole_gpu_device(gpu(numa=None))["attributes"]
    assert "numaNode" not in attributes
    assert "resource.kubernetes.io/numaNode" not in attributes


def test_a_shares_multiprocessors_capacity_is_never_consumed() -> None:
    capacity = shared_gpu_device(gpu())["capacity"]["multiprocessors"]
    assert capacity == {
        "value": "132",
        "requestPolicy": {"default": "0", "validValues": ["0"]},
    }
    # capacity lists only what shares consume: memory and compute.
    slice_ = {
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER_NAME,
            "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "n",
            "devices": [shared_gpu_device(gpu())],
        },
    }
    (row,) = capacity_summary([parse_slice(slice_)], [])
    assert sorted(row.shareable) == ["compute", "memory"]
