"""GPU backend for real nodes, through NVML (the ``pynvml`` module of ``nvidia-ml-py``).

Every NVML call goes through :meth:`NvmlBackend._call`, which turns NVML errors into the typed
errors of ``driver.backend_errors``. Fields a GPU cannot report (NOT_SUPPORTED) are left empty
rather than failing enumeration. The ``nvml`` module is injectable so tests can stub NVML at the
function boundary.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import (
    GpuBackendError,
    GpuLostError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)
from flexgpu.driver.gpu_catalog import spec_for_product_name
from flexgpu.driver.gpu_model import (
    ComputeMode,
    GpuInfo,
    HealthEvent,
    HealthEventKind,
    HealthState,
    MigDevice,
    MigEngines,
    MigMode,
    MigPlacement,
    MigProfile,
    MpsDaemon,
    ProcessSample,
    TimeSliceInterval,
)
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.mps_folders import (
    control_daemon_pid,
    control_daemon_running,
    control_pipe_problem,
    empty_daemon_folders,
    prepare_daemon_folders,
)
from flexgpu.driver.nvlink import NVSWITCH, nvlink_domains, nvlink_peers
from flexgpu.driver.nvml_errors import error_for_code, translate_nvml_error
from flexgpu.driver.pci_address import normalize_pci_bus_id
from flexgpu.driver.sysfs import SysfsPci
from flexgpu.driver.usage import GpuUsage, usage_from_processes
from flexgpu.driver.xid import xid_marks_unhealthy

CommandRunner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]

# NVML reports this for "no MIG instance" in per-process and per-event instance ids.
_NO_INSTANCE = 0xFFFFFFFF
_MIB = 1024 * 1024

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
_COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: ComputeMode.DEFAULT,
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: ComputeMode.EXCLUSIVE_PROCESS,
    pynvml.NVML_COMPUTEMODE_PROHIBITED: ComputeMode.PROHIBITED,
}
# Compute instance profile spanning a whole GPU instance of N compute slices.
_FULL_COMPUTE_INSTANCE = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    6: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    8: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
}
# nvidia-smi compute-policy --set-timeslice takes these numbers.
_TIME_SLICE_ARGUMENT = {
    TimeSliceInterval.DEFAULT: "0",
    TimeSliceInterval.SHORT: "1",
    TimeSliceInterval.MEDIUM: "2",
    TimeSliceInterval.LONG: "3",
}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _instance_id(value: object) -> int | None:
    number = int(value)  # type: ignore[call-overload]
    return None if number == _NO_INSTANCE else number


# Host folder for MPS pipes and logs, one sub-folder per GPU UUID; mounted into containers.
DEFAULT_MPS_ROOT = Path("/run/flexgpu/mps")
_MPS_STOP_TIMEOUT_S = 10.0


def _run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


@dataclass
class _RawGpu:
    """What one GPU reported, before NVLink partners are resolved across the node."""

    index: int
    uuid: str
    bus_id: str
    link_partners: set[str]  # PCI bus ids of linked GPUs, or NVSWITCH
    fields: dict[str, Any]


class NvmlBackend(GpuBackend):
    def __init__(
        self,
        nvml: Any = None,
        *,
        sysfs: SysfsPci | None = None,
        run_command: CommandRunner = _run_command,
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
        self._utilization_seen: dict[int, int] = {}
        self._call("nvmlInit", context="initialise NVML")

    # -- plumbing ------------------------------------------------------------------------

    def _call(self, function: str, *args: Any, context: str = "") -> Any:
        try:
            return getattr(self._nvml, function)(*args)
        except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
            raise translate_nvml_error(exc, context or function) from None

    def _optional(self, function: str, *args: Any) -> Any:
        """A call whose failure on this GPU only means the field is unknown."""
        try:
            return self._call(function, *args)
        except (NotSupportedError, NotFoundError, InvalidArgumentError):
            return None

    def _handle(self, index: int) -> Any:
        try:
            return self._call("nvmlDeviceGetHandleByIndex", index, context=f"GPU {index}")
        except InvalidArgumentError:
            raise NotFoundError(f"no GPU with index {index}") from None

    # -- enumeration ---------------------------------------------------------------------

    def list_gpus(self) -> list[GpuInfo]:
        with self._lock:
            count = int(self._call("nvmlDeviceGetCount"))
            driver_version = _text(self._call("nvmlSystemGetDriverVersion"))
            cuda_version = self._cuda_driver_version()
            raw: list[_RawGpu] = []
            for index in range(count):
                try:
                    raw.append(self._read_gpu(index))
                except GpuLostError:
                    self._note_lost(index)
            # A GPU back on the bus is reported again if it is lost again.
            self._reported_lost -= {gpu.uuid for gpu in raw}
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
        uuid = _text(self._call("nvmlDeviceGetUUID", handle))
        name = _text(self._call("nvmlDeviceGetName", handle))
        memory = self._call("nvmlDeviceGetMemoryInfo", handle)
        bus_id = normalize_pci_bus_id(_text(self._call("nvmlDeviceGetPciInfo", handle).busId))
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
            "memory_mib": int(memory.total) // _MIB,
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
                partners.add(normalize_pci_bus_id(_text(remote.busId)))
            except ValueError:
                partners.add(NVSWITCH)  # H100 switches have no PCI address of their own
        return partners

    def _note_lost(self, index: int) -> None:
        uuid = self._known_uuids.get(index)
        if uuid is not None and uuid not in self._reported_lost:
            self._reported_lost.add(uuid)
            self._pending_events.append(
                HealthEvent(kind=HealthEventKind.GPU_LOST, gpu_index=index, gpu_uuid=uuid)
            )

    # -- MIG -----------------------------------------------------------------------------

    def get_mig_mode(self, index: int) -> MigMode:
        with self._lock:
            current, pending = self._call(
                "nvmlDeviceGetMigMode", self._handle(index), context=f"MIG mode of GPU {index}"
            )
            return MigMode(
                current=current == pynvml.NVML_DEVICE_MIG_ENABLE,
                pending=pending == pynvml.NVML_DEVICE_MIG_ENABLE,
            )

    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        with self._lock:
            mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
            context = f"set MIG mode of GPU {index}"
            status = int(
                self._call("nvmlDeviceSetMigMode", self._handle(index), mode, context=context)
            )
            # RESET_REQUIRED: accepted, becomes current after a GPU reset or reboot.
            if status not in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_RESET_REQUIRED):
                raise error_for_code(status, context)
            return self.get_mig_mode(index)

    def _profile_infos(self, handle: Any) -> list[Any]:
        infos: dict[int, Any] = {}
        for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = self._optional("nvmlDeviceGetGpuInstanceProfileInfo", handle, profile)
            if info is not None and int(info.instanceCount) > 0:
                infos.setdefault(int(info.id), info)
        return list(infos.values())

    def _placements(self, handle: Any, profile_id: int) -> list[MigPlacement]:
        function = "nvmlDeviceGetGpuInstancePossiblePlacements"
        count = ctypes.c_uint(0)
        self._call(function, handle, profile_id, None, ctypes.byref(count))
        array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call(function, handle, profile_id, array, ctypes.byref(count))
        return [MigPlacement(start=array[i].start, size=array[i].size) for i in range(count.value)]

    def _profile(self, handle: Any, info: Any) -> MigProfile:
        placements = self._placements(handle, int(info.id))
        return MigProfile(
            name=_text(info.name).removeprefix("MIG "),
            profile_id=int(info.id),
            compute_slices=int(info.sliceCount),
            memory_slices=max((p.size for p in placements), default=1),
            memory_mib=int(info.memorySizeMB),
            multiprocessors=int(info.multiprocessorCount),
            engines=MigEngines(
                copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount),
                encoders=int(info.encoderCount),
                jpeg_decoders=int(info.jpegCount),
                ofa=int(info.ofaCount),
            ),
            max_instances=int(info.instanceCount),
            placements=tuple(placements),
        )

    def _mig_profiles(self, handle: Any, index: int) -> list[MigProfile]:
        # Raises NotSupportedError on GPUs without MIG.
        self._call("nvmlDeviceGetMigMode", handle, context=f"MIG on GPU {index}")
        profiles = [self._profile(handle, info) for info in self._profile_infos(handle)]
        # NVML lists profiles in its enum order; smallest first, as the simulated catalog lists
        # them, keeps listings and published devices in the same order on either backend.
        return sorted(profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.name))

    def mig_profiles(self, index: int) -> list[MigProfile]:
        with self._lock:
            return self._mig_profiles(self._handle(index), index)

    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        with self._lock:
            handle = self._handle(index)
            self._call("nvmlDeviceGetMigMode", handle, context=f"MIG on GPU {index}")
            return self._placements(handle, profile_id)

    def _mig_handles(self, handle: Any) -> dict[int, list[tuple[int, str]]]:
        """GPU instance id -> (compute instance id, MIG UUID) of every MIG device."""
        found: dict[int, list[tuple[int, str]]] = {}
        for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            except NotFoundError:
                continue
            gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mig))
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mig))
            found.setdefault(gi_id, []).append((ci_id, _text(self._call("nvmlDeviceGetUUID", mig))))
        return found

    def create_mig_device(self, index: int, profile_id: int, placement: MigPlacement) -> MigDevice:
        with self._lock:
            handle = self._handle(index)
            mode = self.get_mig_mode(index)
            if not mode.current:
                raise NotSupportedError(f"MIG mode is disabled on GPU {index}")
            profiles = {p.profile_id: p for p in self._mig_profiles(handle, index)}
            if profile_id not in profiles:
                allowed = ", ".join(f"{p.profile_id} ({p.name})" for p in profiles.values())
                raise InvalidArgumentError(
                    f"unknown MIG profile id {profile_id} on GPU {index}; allowed values: {allowed}"
                )
            profile = profiles[profile_id]
            context = f"create {profile.name} at {placement.start}:{placement.size} on GPU {index}"
            c_placement = pynvml.c_nvmlGpuInstancePlacement_t()
            c_placement.start = placement.start
            c_placement.size = placement.size
            gpu_instance = self._call(
                "nvmlDeviceCreateGpuInstanceWithPlacement",
                handle,
                profile_id,
                ctypes.byref(c_placement),
                context=context,
            )
            try:
                gi_info = self._call("nvmlGpuInstanceGetInfo", gpu_instance, context=context)
                ci_profile = self._call(
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                    gpu_instance,
                    _FULL_COMPUTE_INSTANCE[profile.compute_slices],
                    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    context=context,
                )
                compute_instance = self._call(
                    "nvmlGpuInstanceCreateComputeInstance",
                    gpu_instance,
                    int(ci_profile.id),
                    context=context,
                )
                ci_info = self._call("nvmlComputeInstanceGetInfo", compute_instance)
            except GpuBackendError:
                # Leave no GPU instance without a compute instance behind: it would hold
                # memory slices while being invisible to every workload.
                with contextlib.suppress(GpuBackendError):
                    self._call("nvmlGpuInstanceDestroy", gpu_instance)
                raise
            gi_id, ci_id = int(gi_info.id), int(ci_info.id)
            uuid = dict(self._mig_handles(handle).get(gi_id, [])).get(ci_id)
            return MigDevice(
                parent_index=index,
                parent_uuid=_text(self._call("nvmlDeviceGetUUID", handle)),
                profile_id=profile_id,
                profile_name=profile.name,
                placement=MigPlacement(
                    start=int(gi_info.placement.start), size=int(gi_info.placement.size)
                ),
                gpu_instance_id=gi_id,
                compute_instance_id=ci_id,
                uuid=uuid,
            )

    def destroy_mig_device(self, index: int, gpu_instance_id: int) -> None:
        with self._lock:
            handle = self._handle(index)
            context = f"destroy GPU instance {gpu_instance_id} on GPU {index}"
            self._call("nvmlDeviceGetMigMode", handle, context=context)
            try:
                gpu_instance = self._call(
                    "nvmlDeviceGetGpuInstanceById", handle, gpu_instance_id, context=context
                )
            except InvalidArgumentError:
                raise NotFoundError(f"{context}: no such GPU instance") from None
            for ci_id, _ in self._mig_handles(handle).get(gpu_instance_id, []):
                compute_instance = self._call(
                    "nvmlGpuInstanceGetComputeInstanceById", gpu_instance, ci_id, context=context
                )
                self._call("nvmlComputeInstanceDestroy", compute_instance, context=context)
            self._call("nvmlGpuInstanceDestroy", gpu_instance, context=context)

    def list_mig_devices(self, index: int) -> list[MigDevice]:
        with self._lock:
            handle = self._handle(index)
            mode = self._optional("nvmlDeviceGetMigMode", handle)
            if mode is None or mode[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                return []
            parent_uuid = _text(self._call("nvmlDeviceGetUUID", handle))
            mig_handles = self._mig_handles(handle)
            devices: list[MigDevice] = []
            for info in self._profile_infos(handle):
                capacity = int(info.instanceCount)
                array = (pynvml.c_nvmlGpuInstance_t * capacity)()
                count = ctypes.c_uint(0)
                self._call(
                    "nvmlDeviceGetGpuInstances", handle, int(info.id), array, ctypes.byref(count)
                )
                for slot in range(count.value):
                    gi_info = self._call("nvmlGpuInstanceGetInfo", array[slot])
                    gi_id = int(gi_info.id)
                    compute = mig_handles.get(gi_id, [])
                    devices.append(
                        MigDevice(
                            parent_index=index,
                            parent_uuid=parent_uuid,
                            profile_id=int(info.id),
                            profile_name=_text(info.name).removeprefix("MIG "),
                            placement=MigPlacement(
                                start=int(gi_info.placement.start),
                                size=int(gi_info.placement.size),
                            ),
                            gpu_instance_id=gi_id,
                            compute_instance_id=compute[0][0] if compute else None,
                            uuid=compute[0][1] if compute else None,
                        )
                    )
            return sorted(devices, key=lambda d: d.gpu_instance_id)

    # -- sharing settings ----------------------------------------------------------------

    def get_compute_mode(self, index: int) -> ComputeMode:
        with self._lock:
            mode = int(self._call("nvmlDeviceGetComputeMode", self._handle(index)))
            if mode not in _COMPUTE_MODES:
                raise NotSupportedError(f"GPU {index} reports unknown compute mode {mode}")
            return _COMPUTE_MODES[mode]

    def set_compute_mode(self, index: int, mode: ComputeMode) -> None:
        with self._lock:
            code = next(k for k, v in _COMPUTE_MODES.items() if v == mode)
            self._call(
                "nvmlDeviceSetComputeMode",
                self._handle(index),
                code,
                context=f"set compute mode {mode} on GPU {index}",
            )

    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        # NVML has no call for this outside vGPU; the driver's own tool sets it.
        with self._lock:
            uuid = _text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        argv = [
            self._nvidia_smi,
            "compute-policy",
            "-i",
            uuid,
            f"--set-timeslice={_TIME_SLICE_ARGUMENT[interval]}",
        ]
        try:
            result = self._run_command(argv)
        except FileNotFoundError:
            raise NotSupportedError(
                f"cannot set time slice on GPU {index}: {self._nvidia_smi} not found"
            ) from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuBackendError(f"cannot set time slice on GPU {index}: {exc}") from None
        if result.returncode != 0:
            output = (result.stderr or result.stdout or "").strip()
            message = f"set time slice {interval} on GPU {index}: {output}"
            lowered = output.lower()
            if "permission" in lowered:
                raise PermissionDeniedError(message)
            if "not supported" in lowered:
                raise NotSupportedError(message)
            raise GpuBackendError(message)

    # -- MPS -----------------------------------------------------------------------------

    def _mps_daemon(self, index: int, uuid: str) -> MpsDaemon:
        folder = self._mps_root / uuid
        return MpsDaemon(
            gpu_index=index,
            gpu_uuid=uuid,
            pipe_dir=str(folder / "pipe"),
            log_dir=str(folder / "log"),
            shm_dir=str(folder / "shm"),
        )

    @staticmethod
    def _mps_alive(daemon: MpsDaemon) -> bool:
        # Found by its process, not by the pid file it writes into the pipe folder: clients
        # mount that folder read-write, so the file may be theirs (mps_folders.py).
        return control_daemon_running(daemon.pipe_dir)

    def _mps_command(
        self,
        daemon: MpsDaemon,
        index: int,
        action: str,
        *argv: str,
        visible: str | None = None,
    ) -> None:
        env = [
            "env",
            f"CUDA_VISIBLE_DEVICES={visible or daemon.gpu_uuid}",
            f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}",
            f"CUDA_MPS_LOG_DIRECTORY={daemon.log_dir}",
        ]
        try:
            result = self._run_command([*env, *argv])
        except FileNotFoundError:
            raise NotSupportedError(
                f"cannot {action} MPS on GPU {index}: {self._mps_control} not found"
            ) from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuBackendError(f"cannot {action} MPS on GPU {index}: {exc}") from None
        if result.returncode != 0:
            output = (result.stderr or result.stdout or "").strip()
            if result.returncode == 127:
                raise NotSupportedError(
                    f"cannot {action} MPS on GPU {index}: {self._mps_control} not found"
                )
            raise GpuBackendError(f"{action} MPS on GPU {index}: {output}")

    def start_mps_daemon(self, index: int) -> MpsDaemon:
        with self._lock:
            uuid = _text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        daemon = self._mps_daemon(index, uuid)
        if self._mps_alive(daemon):
            return daemon
        self.set_compute_mode(index, ComputeMode.EXCLUSIVE_PROCESS)
        self._launch_mps(daemon, index, uuid)
        return daemon

    def _launch_mps(self, daemon: MpsDaemon, index: int, visible: str) -> None:
        # What an earlier daemon's clients left there (a FIFO, a symlink, a pid file) is never
        # served or trusted (mps_folders.py).
        prepare_daemon_folders(daemon.pipe_dir, daemon.log_dir, daemon.shm_dir)
        # The daemon gets a mount namespace of its own whose /dev/shm is the GPU's shm folder;
        # clients get the same folder at /dev/shm through their CDI mounts.
        script = f"mount --bind {daemon.shm_dir} /dev/shm && exec {self._mps_control} -d"
        self._mps_command(
            daemon,
            index,
            "start",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            visible=visible,
        )

    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        live = {
            m.uuid
            for gpu in self.list_gpus()
            for m in self.list_mig_devices(gpu.index)
            if m.uuid is not None
        }
        missing = [u for u in spec.device_uuids if u not in live]
        if missing:
            raise NotFoundError(f"no MIG device {', '.join(missing)}: cannot start its MPS daemon")
        daemon = self._mps_daemon(spec.parent_index, spec.key)
        # No compute mode change: it is the parent GPU's, and its other partitions are
        # other claims'.
        if not self._mps_alive(daemon):
            self._launch_mps(daemon, spec.parent_index, spec.visible_devices)
        # Told again to an adopted daemon too: setting a default twice changes nothing.
        commands = spec.control_commands()
        problem = control_pipe_problem(daemon.pipe_dir) if commands else None
        if problem is not None:
            raise GpuBackendError(f"not telling the MPS daemon of {spec.key} its limits: {problem}")
        for command in commands:
            self._mps_command(
                daemon,
                spec.parent_index,
                "configure",
                "sh",
                "-c",
                f"echo {command} | {self._mps_control}",
                visible=spec.visible_devices,
            )
        return daemon

    def stop_mps_daemon(self, index: int) -> None:
        with self._lock:
            uuid = _text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        self._stop_mps(self._mps_daemon(index, uuid), index)
        self.set_compute_mode(index, ComputeMode.DEFAULT)

    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        self._stop_mps(self._mps_daemon(parent_index, uuid), parent_index)

    def _stop_mps(self, daemon: MpsDaemon, index: int) -> None:
        """``quit`` on the control pipe; through a pipe a client replaced, SIGTERM to the
        daemon's process instead (never a write as root to whatever the pipe now is)."""
        pid = control_daemon_pid(daemon.pipe_dir)
        if pid is not None and control_pipe_problem(daemon.pipe_dir) is None:
            self._mps_command(daemon, index, "stop", "sh", "-c", f"echo quit | {self._mps_control}")
        elif pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        # Its last claim gone, nothing of its clients stays for the GPU's next tenant; once it
        # has ended (a daemon still running keeps its files: the unprepare fails and is
        # tried again, its record kept).
        deadline = time.monotonic() + _MPS_STOP_TIMEOUT_S
        while control_daemon_pid(daemon.pipe_dir) is not None:
            if time.monotonic() > deadline:
                raise GpuBackendError(
                    f"the MPS daemon of {daemon.gpu_uuid} did not end within "
                    f"{_MPS_STOP_TIMEOUT_S:.0f} s of being told to"
                )
            time.sleep(0.05)
        empty_daemon_folders(daemon.pipe_dir, daemon.shm_dir)

    def mps_daemons(self) -> list[MpsDaemon]:
        running = []
        for gpu in self.list_gpus():
            # A MIG device daemon's folder is named after its first device's UUID.
            keys = [gpu.uuid] + [m.uuid for m in self.list_mig_devices(gpu.index) if m.uuid]
            for key in keys:
                daemon = self._mps_daemon(gpu.index, key)
                if self._mps_alive(daemon):
                    running.append(daemon)
        return running

    # -- health and processes ------------------------------------------------------------

    def _ensure_event_set(self) -> Any:
        if self._event_set is not None:
            return self._event_set
        event_set = self._call("nvmlEventSetCreate")
        for index in range(int(self._call("nvmlDeviceGetCount"))):
            try:
                handle = self._handle(index)
                self._known_uuids.setdefault(index, _text(self._call("nvmlDeviceGetUUID", handle)))
                supported = self._optional("nvmlDeviceGetSupportedEventTypes", handle)
                mask = int(supported or 0) & pynvml.nvmlEventTypeXidCriticalError
                if mask:
                    self._call("nvmlDeviceRegisterEvents", handle, mask, event_set)
            except (GpuLostError, NotSupportedError):
                self._note_lost(index)
        self._event_set = event_set
        return event_set

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        with self._lock:
            if self._pending_events:
                return self._pending_events.popleft()
            event_set = self._ensure_event_set()
        try:
            data = self._nvml.nvmlEventSetWait(event_set, max(int(timeout_s * 1000), 0))
        except pynvml.NVMLError as exc:
            if exc.value == pynvml.NVML_ERROR_TIMEOUT:
                return None
            if exc.value == pynvml.NVML_ERROR_GPU_IS_LOST:
                # Some GPU of the set is gone; a fresh enumeration finds which.
                with self._lock:
                    self.list_gpus()
                    return self._pending_events.popleft() if self._pending_events else None
            raise translate_nvml_error(exc, "wait for GPU events") from None
        if not int(data.eventType) & pynvml.nvmlEventTypeXidCriticalError:
            return None
        with self._lock:
            uuid = _text(self._call("nvmlDeviceGetUUID", data.device))
            index = self._index_of(uuid)
            if index is None:
                return None  # a GPU this backend never enumerated; nothing to attribute it to
            xid = int(data.eventData)
            if xid_marks_unhealthy(xid):
                self._unhealthy.add(index)
        return HealthEvent(
            kind=HealthEventKind.XID,
            gpu_index=index,
            gpu_uuid=uuid,
            xid=xid,
            gpu_instance_id=_instance_id(data.gpuInstanceId),
            compute_instance_id=_instance_id(data.computeInstanceId),
        )

    def _index_of(self, uuid: str) -> int | None:
        for _ in range(2):
            for index, known in self._known_uuids.items():
                if known == uuid:
                    return index
            self.list_gpus()  # indices may have been learnt before this GPU appeared
        return None

    def process_samples(self, index: int) -> list[ProcessSample]:
        with self._lock:
            handle = self._handle(index)
            processes = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
            since = self._utilization_seen.get(index, 0)
            utilization: dict[int, Any] = {}
            for sample in self._optional("nvmlDeviceGetProcessUtilization", handle, since) or []:
                utilization[int(sample.pid)] = sample
                self._utilization_seen[index] = max(
                    self._utilization_seen.get(index, 0), int(sample.timeStamp)
                )
            samples = []
            for process in processes:
                pid = int(process.pid)
                used = process.usedGpuMemory
                util = utilization.get(pid)
                samples.append(
                    ProcessSample(
                        pid=pid,
                        used_memory_mib=None if used is None else int(used) // _MIB,
                        sm_utilization_percent=int(util.smUtil) if util is not None else None,
                        memory_utilization_percent=int(util.memUtil) if util is not None else None,
                        gpu_instance_id=_instance_id(process.gpuInstanceId),
                        compute_instance_id=_instance_id(process.computeInstanceId),
                    )
                )
            return samples

    def gpu_usage(self, index: int) -> GpuUsage:
        with self._lock:
            handle = self._handle(index)
            processes = self.process_samples(index)
            # NOT_SUPPORTED in MIG mode, where NVML has no device-level utilisation.
            rates = self._optional("nvmlDeviceGetUtilizationRates", handle)
            memory = self._optional("nvmlDeviceGetMemoryInfo", handle)
            mode = self._optional("nvmlDeviceGetMigMode", handle)
            instances: dict[int, int | None] = {}
            if mode is not None and int(mode[0]) == pynvml.NVML_DEVICE_MIG_ENABLE:
                for slot in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", handle))):
                    try:
                        mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
                    except NotFoundError:
                        continue
                    gi_id = int(self._call("nvmlDeviceGetGpuInstanceId", mig))
                    info = self._optional("nvmlDeviceGetMemoryInfo", mig)
                    instances[gi_id] = None if info is None else int(info.used) // _MIB
        usage = usage_from_processes(
            index,
            processes,
            list(instances),
            None if rates is None else int(rates.gpu),
            None if memory is None else int(memory.used) // _MIB,
        )
        # An instance's own memory figure (it includes what the driver holds there).
        mig = tuple(
            m.model_copy(update={"memory_used_mib": instances[m.gpu_instance_id]})
            if instances.get(m.gpu_instance_id) is not None
            else m
            for m in usage.mig
        )
        return usage.model_copy(update={"mig": mig})

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
