"""A node's GPU inventory as one snapshot: GPUs, their MIG profiles and existing MIG devices."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import NotSupportedError
from flexgpu.driver.gpu_model import GpuInfo, MigDevice, MigProfile


class GpuInventory(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu: GpuInfo
    mig_profiles: tuple[MigProfile, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()


class NodeInventory(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: tuple[GpuInventory, ...]


def collect_inventory(backend: GpuBackend) -> NodeInventory:
    """Read everything the backend reports; only reads, never changes a GPU setting."""
    entries = []
    for gpu in backend.list_gpus():
        profiles: list[MigProfile] = []
        devices: list[MigDevice] = []
        if gpu.mig_capable:
            try:
                profiles = backend.mig_profiles(gpu.index)
            except NotSupportedError:
                profiles = []  # MIG-capable but the driver refuses profile queries
            devices = backend.list_mig_devices(gpu.index)
        entries.append(
            GpuInventory(gpu=gpu, mig_profiles=tuple(profiles), mig_devices=tuple(devices))
        )
    return NodeInventory(gpus=tuple(entries))
