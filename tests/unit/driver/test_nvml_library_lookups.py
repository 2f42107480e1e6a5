"""The NVML calls NVIDIA's DRA kubelet plugin makes beyond flexgpu's own, as the NVML mock
library (tools/nvml-mock) answers them through the unmodified pynvml module: a device found by
its UUID (a GPU's or a MIG device's) or by its PCI bus id in either of NVML's forms, the
platform's addressing mode (as the machine description sets it, NOT_SUPPORTED where it sets
none) and the virtualization mode of a bare-metal GPU."""

from __future__ import annotations

from typing import Any

import pynvml
import pytest
from conftest import LibraryNode

from flexgpu.driver.gpu_model import MigPlacement

UUID = "GPU-00000001-0000-4000-8000-000000000000"


def _machine(**extra: Any) -> dict[str, Any]:
    gpu = {"model": "A100-SXM4-80GB", "uuid": UUID, "pciBusId": "0000:3a:00.0", "migEnabled": True}
    return {"gpus": [gpu], **extra}


def test_gpu_found_by_uuid_and_by_either_bus_id_form(library_node: LibraryNode) -> None:
    library_node(_machine())
    by_index = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(UUID)) == UUID
    for bus_id in ("0000:3a:00.0", "00000000:3A:00.0"):
        found = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        assert pynvml.nvmlDeviceGetUUID(found) == UUID
        assert pynvml.nvmlDeviceGetIndex(found) == pynvml.nvmlDeviceGetIndex(by_index)


def test_unknown_uuid_and_bus_id_are_not_found(library_node: LibraryNode) -> None:
    library_node(_machine())
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-ffffffff-0000-4000-8000-000000000000")
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByPciBusId("0000:3b:00.0")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByPciBusId("not-a-bus-id")


def test_mig_device_found_by_its_own_uuid(library_node: LibraryNode) -> None:
    backend, _ = library_node(_machine())
    created = backend.create_mig_device(0, 19, MigPlacement(start=3, size=1))
    mig = pynvml.nvmlDeviceGetHandleByUUID(created.uuid)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1  # pynvml returns the c_uint
    assert pynvml.nvmlDeviceGetUUID(mig) == created.uuid
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == created.gpu_instance_id


def test_addressing_mode_is_not_supported_unless_the_machine_sets_one(
    library_node: LibraryNode,
) -> None:
    library_node(_machine())
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetAddressingMode(pynvml.nvmlDeviceGetHandleByIndex(0))


@pytest.mark.parametrize(("name", "value"), [("None", 0), ("HMM", 1), ("ATS", 2)])
def test_addressing_mode_is_the_machines(library_node: LibraryNode, name: str, value: int) -> None:
    library_node(_machine(addressingMode=name))
    assert pynvml.nvmlDeviceGetAddressingMode(pynvml.nvmlDeviceGetHandleByIndex(0)) == value


def test_bare_metal_gpu_has_no_virtualization(library_node: LibraryNode) -> None:
    library_node(_machine())
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    mode = pynvml.nvmlDeviceGetVirtualizationMode(handle)
    assert mode == pynvml.NVML_GPU_VIRTUALIZATION_MODE_NONE
