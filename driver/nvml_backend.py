"""GPU backend for real nodes, through NVML (the ``pynvml`` module of ``nvidia-ml-py``).

Assembled from one class per job (nvml_mig, nvml_sharing, nvml_health) on nvml_calls, whose
``_call`` every NVML call goes through: it turns NVML errors into the typed
errors of ``driver.backend_errors``. Fields a GPU cannot report (NOT_SUPPORTED) are left empty
rather than failing enumeration. The ``nvml`` module is injectable so tests can stub NVML at the
function boundary.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from flexgpu.driver.backend_errors import (
    GpuBackendError,
    GpuLostError,
)
from flexgpu.driver.gpu_catalog import spec_for_product_name
from flexgpu.driver.gpu_model import (
    GpuInfo,
    HealthEvent,
    HealthState,
    MigMode,
    MigProfile,
)
from flexgpu.driver.nvlink import NVSWITCH, nvlink_domains, nvlink_peers
from flexgpu.driver.nvml_calls import MIB, CommandRunner, NvmlCalls, nvml_text
from flexgpu.driver.nvml_health import NvmlHealth
from flexgpu.driver.nvml_mig import NvmlMig
from flexgpu.driver.nvml_sharing import DEFAULT_MPS_ROOT, NvmlSharing, run_tool
from flexgpu.driver.pci_address import normalize_pci_bus_id
from flexgpu.driver.sysfs import SysfsPci

_ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
}
_BRANDS = {
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA: "NVIDIA",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NVIDIA RTX",
    pynvml.NVML_BRAND_QUADRO_RTX: "Quadro RTX",
}


@dataclass
class _RawGpu:
    """What one GPU reported, before NVLink partners are resolved across the node."""

    index: int
    uuid: str
    bus_id: str
    link_partners: set[str]  # PCI bus ids of linked GPUs, or NVSWITCH
    fields: dict[str, Any]


class NvmlBackend(NvmlMig, NvmlSharing, NvmlHealth, NvmlCalls):
    def __init__(
        self,
        nvml: Any = None,
        *,
        sysfs: SysfsPci | None = None,
        run_command: CommandRunner = run_tool,
        nvidia_smi: str = "nvidia-smi",
        mps_root: Path = DEFAULT_MPS_ROOT,
        mps_control: str = "nvidia-cuda-mps-control",
    ) -> None:
        # ``nvml`` is the pynvml module or a stand-in with the same functions.
        self._nvml: Any = nvml if nvml is not None else pynvml
        self._sysfs = sysfs or SysfsPci()
        self._run_command = run_command
        self._nvidia_smi = nvidia_smi
        self._mps_root = mps_root
        self._mps_control = mps_control
        self._lock = threading.RLock()
        self._known_uuids: dict[int, str] = {}
        self._reported_lost: set[str] = set()
        self._pending_events: deque[HealthEvent] = deque()
        self._unhealthy: set[int] = set()
        self._event_set: Any = None
        self._event_set_gpus: set[int] = set()
        self._event_set_stale = False
        self._utilization_seen: dict[int, int] = {}
        self._mig_profile_cache: dict[tuple[str, bool], tuple[MigProfile, ...]] = {}
        self._call("nvmlInit", context="initialise NVML")

    # -- enumeration ---------------------------------------------------------------------

    def list_gpus(self) -> list[GpuInfo]:
        with self._lock:
            count = int(self._call("nvmlDeviceGetCount"))
            driver_version = nvml_text(self._call("nvmlSystemGetDriverVersion"))
            cuda_version = self._cuda_driver_version()
            raw: list[_RawGpu] = []
            for index in range(count):
                try:
                    raw.append(self._read_gpu(index))
                except GpuLostError:
                    self._note_lost(index)
            # A GPU back on the bus is reported again if it is lost again.
            self._reported_lost -= {gpu.uuid for gpu in raw}
            self._answering_gpus_changed({gpu.index for gpu in raw})
            uuid_by_bus = {gpu.bus_id: gpu.uuid for gpu in raw}
            links = {
                gpu.uuid: {
                    NVSWITCH if p == NVSWITCH else uuid_by_bus[p]
                    for p in gpu.link_partners
                    if p == NVSWITCH or p in uuid_by_bus
                }
                for gpu in raw
            }
            domains = nvlink_domains(links)
            peers = nvlink_peers(links)
            index_by_uuid = {gpu.uuid: gpu.index for gpu in raw}
            self._known_uuids.update({gpu.index: gpu.uuid for gpu in raw})
            return [
                GpuInfo(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    driver_version=driver_version,
                    cuda_driver_version=cuda_version,
                    pci_bus_id=gpu.bus_id,
                    nvlink_domain=domains[gpu.uuid],
                    nvlink_peers=tuple(sorted(index_by_uuid[p] for p in peers[gpu.uuid])),
                    health=(
                        HealthState.UNHEALTHY
                        if gpu.index in self._unhealthy
                        else HealthState.HEALTHY
                    ),
                    **gpu.fields,
                )
                for gpu in raw
            ]

    def _cuda_driver_version(self) -> str:
        version = self._optional("nvmlSystemGetCudaDriverVersion_v2")
        if version is None:
            version = self._call("nvmlSystemGetCudaDriverVersion")
        number = int(version)  # e.g. 13000 for 13.0, 12040 for 12.4
        return f"{number // 1000}.{(number % 1000) // 10}"

    def _read_gpu(self, index: int) -> _RawGpu:
        handle = self._handle(index)
        uuid = nvml_text(self._call("nvmlDeviceGetUUID", handle))
        name = nvml_text(self._call("nvmlDeviceGetName", handle))
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        bus_id = normalize_pci_bus_id(nvml_text(self._call("nvmlDeviceGetPciInfo", handle).busId))
        major, minor = self._call("nvmlDeviceGetCudaComputeCapability", handle)
        brand = self._optional("nvmlDeviceGetBrand", handle)
        architecture = self._optional("nvmlDeviceGetArchitecture", handle)
        mig = self._optional("nvmlDeviceGetMigMode", handle)
        fields: dict[str, Any] = {
            "product_name": name,
            "brand": _BRANDS.get(brand, "Unknown") if brand is not None else "Unknown",
            "architecture": _ARCHITECTURES.get(architecture, "Unknown")
            if architecture is not None
            else "Unknown",
            "cuda_compute_capability": f"{major}.{minor}",
            "memory_mib": int(memory.total) // MIB,
            "multiprocessors": self._multiprocessors(handle, name),
            "pcie_root": self._sysfs.pcie_root(bus_id),
            "numa_node": self._sysfs.numa_node(bus_id),
            "minor_number": self._optional("nvmlDeviceGetMinorNumber", handle),
            "mig_capable": mig is not None,
            "mig_mode": (
                MigMode(
                    current=mig[0] == pynvml.NVML_DEVICE_MIG_ENABLE,
                    pending=mig[1] == pynvml.NVML_DEVICE_MIG_ENABLE,
                )
                if mig is not None
                else None
            ),
        }
        return _RawGpu(index, uuid, bus_id, self._link_partners(handle), fields)

    def _multiprocessors(self, handle: Any, product_name: str) -> int | None:
        attributes = self._optional("nvmlDeviceGetAttributes", handle)
        if attributes is not None and int(attributes.multiprocessorCount) > 0:
            return int(attributes.multiprocessorCount)
        # NVML only reports SM counts for MIG devices on many drivers; known products fill in.
        spec = spec_for_product_name(product_name)
        return spec.multiprocessors if spec else None

    def _link_partners(self, handle: Any) -> set[str]:
        partners: set[str] = set()
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            state = self._optional("nvmlDeviceGetNvLinkState", handle, link)
            if state is None:
                if link == 0:
                    break  # no NVLink on this GPU
                continue
            if state != pynvml.NVML_FEATURE_ENABLED:
                continue
            kind = self._optional("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                partners.add(NVSWITCH)
                continue
            remote = self._optional("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            if remote is None:
                continue
            try:
                partners.add(normalize_pci_bus_id(nvml_text(remote.busId)))
            except ValueError:
                partners.add(NVSWITCH)  # H100 switches have no PCI address of their own
        return partners

    def close(self) -> None:
        with self._lock:
            try:
                if self._event_set is not None:
                    self._call("nvmlEventSetFree", self._event_set)
                self._call("nvmlShutdown")
            except GpuBackendError:
                pass  # shutting down anyway
            finally:
                self._event_set = None
