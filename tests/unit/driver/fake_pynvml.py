"""A stand-in for the ``pynvml`` module holding the state of simulated hardware.

Only for NVML error paths the NVML mock library (tools/nvml-mock) cannot produce, such as a
call failing with a code the library never returns there, or a GPU lost in the middle of one
enumeration; every other NVML backend test runs the real pynvml module over that library.
It offers the same functions the real module does, with the same argument conventions (ctypes
arrays and ``byref`` counts filled in place, opaque ctypes handles) and raises the real
``pynvml.NVMLError`` subclasses with NVML's codes, so ``NvmlBackend`` runs unchanged against it.
Figures are what NVML reports on the products modelled (A100-SXM4-80GB with driver 580, T4).
Anything not defined here falls through to the real module (constants, structures, errors).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

NO_INSTANCE = 0xFFFFFFFF
MIB = 1024 * 1024


@dataclass
class FakeProfile:
    enum: int
    id: int
    name: str
    slices: int
    instances: int
    sms: int
    ce: int
    dec: int
    jpeg: int
    ofa: int
    memory_mb: int
    starts: tuple[int, ...]
    size: int


# `nvidia-smi mig -lgip` / `-lgipp` of an A100-SXM4-80GB.
A100_80GB_PROFILES = [
    FakeProfile(0, 19, "MIG 1g.10gb", 1, 7, 14, 1, 0, 0, 0, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    FakeProfile(7, 20, "MIG 1g.10gb+me", 1, 1, 14, 1, 1, 1, 1, 9728, (0, 1, 2, 3, 4, 5, 6), 1),
    FakeProfile(9, 15, "MIG 1g.20gb", 1, 4, 14, 1, 1, 0, 0, 19968, (0, 2, 4, 6), 2),
    FakeProfile(1, 14, "MIG 2g.20gb", 2, 3, 28, 2, 1, 0, 0, 19968, (0, 2, 4), 2),
    FakeProfile(2, 9, "MIG 3g.40gb", 3, 2, 42, 3, 2, 0, 0, 40192, (0, 4), 4),
    FakeProfile(3, 5, "MIG 4g.40gb", 4, 1, 56, 4, 2, 0, 0, 40192, (0,), 4),
    FakeProfile(4, 0, "MIG 7g.80gb", 7, 1, 98, 7, 5, 1, 1, 80896, (0,), 8),
]
# NVML compute instance profile enum -> id for the full-size compute instance.
CI_PROFILE_IDS = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 6}


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str  # as NVML prints it, 8-digit domain
    memory_mib: int
    arch: int
    cc: tuple[int, int]
    brand: int = pynvml.NVML_BRAND_NVIDIA
    profiles: list[FakeProfile] | None = None  # None: no MIG support
    mig_enabled: bool = False
    mig_pending: bool = False
    nvlink: list[str] | None = None  # per link: remote bus id, or "switch"; None: no NVLink
    compute_mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    lost: bool = False
    processes: list[SimpleNamespace] = field(default_factory=list)
    # gpu instance id -> (profile, start, size, compute instance ids)
    instances: dict[int, tuple[FakeProfile, int, int, list[int]]] = field(default_factory=dict)


def a100_80gb(uuid: str, bus_id: str, mig_enabled: bool = True) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        uuid=uuid,
        bus_id=bus_id,
        memory_mib=81920,
        arch=pynvml.NVML_DEVICE_ARCH_AMPERE,
        cc=(8, 0),
        profiles=A100_80GB_PROFILES,
        mig_enabled=mig_enabled,
        mig_pending=mig_enabled,
        nvlink=["none"] * 12,
    )


def t4(uuid: str, bus_id: str) -> FakeGpu:
    return FakeGpu(
        name="Tesla T4",
        uuid=uuid,
        bus_id=bus_id,
        memory_mib=15360,
        arch=pynvml.NVML_DEVICE_ARCH_TURING,
        cc=(7, 5),
    )


@dataclass
class FakeEventSet:
    """One event set: the GPUs registered in it and how far it has read the raised events."""

    read: int
    registered: set[int] = field(default_factory=set)
    freed: bool = False


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _gpu_instance_id(start: int, size: int) -> int:
    return {8: 0, 4: 1, 2: 3, 1: 7}[size] + start // size


def _deref(ref: Any) -> Any:
    return ref._obj if hasattr(ref, "_obj") else ref.contents


class FakeNvml:
    """Module-like object: ``NvmlBackend(nvml=FakeNvml([...]))``."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        driver_version: str = "580.95.05",
        cuda_version: int = 13000,
        library_present: bool = True,
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.library_present = library_present
        self.initialized = False
        self.calls: list[str] = []
        self._objects: dict[int, Any] = {}
        self._keep: list[Any] = []
        self._events: list[tuple[int, int]] = []  # (GPU index, Xid) in the order raised
        self._event_ready = threading.Condition()
        self._event_sets: list[FakeEventSet] = []
        # NVML answering an event wait GPU_IS_LOST while every GPU still answers: a state the
        # library never reaches, for the backend's handling of it.
        self.wait_answers_lost = False

    def __getattr__(self, name: str) -> Any:
        # Constants, structures and error classes come from the real module.
        return getattr(pynvml, name)

    # -- handle plumbing -----------------------------------------------------------------

    def _handle(self, pointer_type: Any, target: Any) -> Any:
        struct = pointer_type._type_()
        self._keep.append(struct)
        self._objects[ctypes.addressof(struct)] = target
        return ctypes.pointer(struct)

    def _resolve(self, handle: Any) -> Any:
        try:
            return self._objects[ctypes.addressof(handle.contents)]
        except (KeyError, ValueError, AttributeError):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if not self.initialized:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, name: str, handle: Any) -> tuple[int, FakeGpu]:
        self._enter(name)
        target = self._resolve(handle)
        if not (isinstance(target, tuple) and target[0] == "gpu"):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[target[1]]
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return target[1], gpu

    def _mig_gpu(self, name: str, handle: Any) -> tuple[int, FakeGpu]:
        index, gpu = self._gpu(name, handle)
        if gpu.profiles is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return index, gpu

    def _profile_by_id(self, gpu: FakeGpu, profile_id: int) -> FakeProfile:
        for profile in gpu.profiles or []:
            if profile.id == profile_id:
                return profile
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gi(self, name: str, handle: Any) -> tuple[int, FakeGpu, int]:
        self._enter(name)
        target = self._resolve(handle)
        if not (isinstance(target, tuple) and target[0] == "gi"):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[target[1]]
        if target[2] not in gpu.instances:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return target[1], gpu, target[2]

    # -- test controls -------------------------------------------------------------------

    def raise_xid(self, index: int, xid: int) -> None:
        with self._event_ready:
            self._events.append((index, xid))
            self._event_ready.notify_all()

    def lose_gpu(self, index: int) -> None:
        with self._event_ready:
            self.gpus[index].lost = True
            self._event_ready.notify_all()

    # -- library -------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if not self.library_present:
            raise _error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.gpus[index].lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._handle(pynvml.c_nvmlDevice_t, ("gpu", index))

    # -- identity ------------------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID")
        target = self._resolve(handle)
        if target[0] == "mig":
            return str(target[4])
        gpu = self.gpus[target[1]]
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu("nvmlDeviceGetName", handle)[1].name

    def nvmlDeviceGetBrand(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetBrand", handle)[1].brand

    def nvmlDeviceGetArchitecture(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetArchitecture", handle)[1].arch

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        # The driver numbers /dev/nvidia<N> in probe order, which matches the index here.
        return int(self._gpu("nvmlDeviceGetMinorNumber", handle)[0])

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu("nvmlDeviceGetCudaComputeCapability", handle)[1].cc

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)[1]
        memory = pynvml.c_nvmlMemory_t()
        memory.total = gpu.memory_mib * MIB
        memory.used = 0
        memory.free = memory.total
        return memory

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)[1]
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id.encode()
        return info

    def nvmlDeviceGetAttributes(self, handle: Any) -> Any:
        # Full-GPU handles: not supported (only MIG device handles carry attributes).
        self._gpu("nvmlDeviceGetAttributes", handle)
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    # -- NVLink --------------------------------------------------------------------------

    def _link(self, name: str, handle: Any, link: int) -> str:
        gpu = self._gpu(name, handle)[1]
        if gpu.nvlink is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlink):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink[link]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        target = self._link("nvmlDeviceGetNvLinkState", handle, link)
        return pynvml.NVML_FEATURE_DISABLED if target == "none" else pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        target = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if target == "switch":
            return pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
        return pynvml.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        target = self._link("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        info = pynvml.nvmlPciInfo_t()
        info.busId = b"" if target in ("none", "switch") else target.encode()
        return info

    # -- MIG -----------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        gpu = self._mig_gpu("nvmlDeviceGetMigMode", handle)[1]
        return [int(gpu.mig_enabled), int(gpu.mig_pending)]

    def nvmlDeviceSetMigMode(self, handle: Any, mode: int) -> int:
        gpu = self._mig_gpu("nvmlDeviceSetMigMode", handle)[1]
        wanted = mode == pynvml.NVML_DEVICE_MIG_ENABLE
        if gpu.instances and wanted != gpu.mig_enabled:
            raise _error(pynvml.NVML_ERROR_IN_USE)
        gpu.mig_pending = wanted
        if gpu.processes:
            # The reset that activates the mode fails while processes hold the GPU.
            return pynvml.NVML_ERROR_IN_USE
        gpu.mig_enabled = wanted
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: Any, profile: int) -> Any:
        gpu = self._mig_gpu("nvmlDeviceGetGpuInstanceProfileInfo", handle)[1]
        for p in gpu.profiles or []:
            if p.enum == profile:
                info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id, info.sliceCount, info.instanceCount = p.id, p.slices, p.instances
                info.multiprocessorCount, info.copyEngineCount = p.sms, p.ce
                info.decoderCount, info.encoderCount, info.jpegCount = p.dec, 0, p.jpeg
                info.ofaCount, info.memorySizeMB, info.name = p.ofa, p.memory_mb, p.name.encode()
                return info
        if 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: Any, profile_id: int, placements: Any, count_ref: Any
    ) -> int:
        gpu = self._mig_gpu("nvmlDeviceGetGpuInstancePossiblePlacements", handle)[1]
        profile = self._profile_by_id(gpu, profile_id)
        count = _deref(count_ref)
        if placements is not None:
            if len(placements) < len(profile.starts):
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
            for i, start in enumerate(profile.starts):
                placements[i].start, placements[i].size = start, profile.size
        count.value = len(profile.starts)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, handle: Any, profile_id: int, placement_ref: Any
    ) -> Any:
        index, gpu = self._mig_gpu("nvmlDeviceCreateGpuInstanceWithPlacement", handle)
        if not gpu.mig_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile = self._profile_by_id(gpu, profile_id)
        placement = _deref(placement_ref)
        start, size = placement.start, placement.size
        if start not in profile.starts or size != profile.size:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        same = [i for i in gpu.instances.values() if i[0].id == profile_id]
        if len(same) >= profile.instances:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        for _, other_start, other_size, _ in gpu.instances.values():
            if start < other_start + other_size and other_start < start + size:
                raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        if sum(i[0].slices for i in gpu.instances.values()) + profile.slices > 7:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi_id = _gpu_instance_id(start, size)
        gpu.instances[gi_id] = (profile, start, size, [])
        return self._handle(pynvml.c_nvmlGpuInstance_t, ("gi", index, gi_id))

    def nvmlGpuInstanceGetInfo(self, gi_handle: Any) -> Any:
        _, gpu, gi_id = self._gi("nvmlGpuInstanceGetInfo", gi_handle)
        profile, start, size, _ = gpu.instances[gi_id]
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = gi_id, profile.id
        info.placement.start, info.placement.size = start, size
        return info

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, gi_handle: Any, profile: int, engine_profile: int
    ) -> Any:
        _, gpu, gi_id = self._gi("nvmlGpuInstanceGetComputeInstanceProfileInfo", gi_handle)
        slices = gpu.instances[gi_id][0].slices
        slices_by_enum = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}
        if engine_profile != 0 or slices_by_enum.get(profile, 99) > slices:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount = CI_PROFILE_IDS[profile], slices_by_enum[profile]
        info.instanceCount = slices // slices_by_enum[profile]
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi_handle: Any, ci_profile_id: int) -> Any:
        index, gpu, gi_id = self._gi("nvmlGpuInstanceCreateComputeInstance", gi_handle)
        compute = gpu.instances[gi_id][3]
        if compute:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        compute.append(0)
        return self._handle(pynvml.c_nvmlComputeInstance_t, ("ci", index, gi_id, 0))

    def nvmlComputeInstanceGetInfo(self, ci_handle: Any) -> Any:
        self._enter("nvmlComputeInstanceGetInfo")
        _, _, _, ci_id = self._resolve(ci_handle)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.id = ci_id
        return info

    def _mig_uuid(self, index: int, gi_id: int) -> str:
        return f"MIG-{self.gpus[index].uuid[4:12]}-0000-4000-8000-{gi_id:012x}"

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        self._mig_gpu("nvmlDeviceGetMaxMigDeviceCount", handle)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: int) -> Any:
        index, gpu = self._mig_gpu("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        devices = [(gi, ci) for gi, inst in sorted(gpu.instances.items()) for ci in inst[3]]
        if slot >= len(devices):
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        gi_id, ci_id = devices[slot]
        target = ("mig", index, gi_id, ci_id, self._mig_uuid(index, gi_id))
        return self._handle(pynvml.c_nvmlDevice_t, target)

    def nvmlDeviceGetGpuInstanceId(self, mig_handle: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        return int(self._resolve(mig_handle)[2])

    def nvmlDeviceGetComputeInstanceId(self, mig_handle: Any) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        return int(self._resolve(mig_handle)[3])

    def nvmlDeviceGetGpuInstances(
        self, handle: Any, profile_id: int, array: Any, count_ref: Any
    ) -> int:
        index, gpu = self._mig_gpu("nvmlDeviceGetGpuInstances", handle)
        if not gpu.mig_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        profile = self._profile_by_id(gpu, profile_id)
        matching = [gi for gi, inst in sorted(gpu.instances.items()) if inst[0].id == profile_id]
        if len(array) < profile.instances:
            raise _error(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for slot, gi_id in enumerate(matching):
            array[slot] = self._handle(pynvml.c_nvmlGpuInstance_t, ("gi", index, gi_id))
        _deref(count_ref).value = len(matching)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: int) -> Any:
        index, gpu = self._mig_gpu("nvmlDeviceGetGpuInstanceById", handle)
        if not gpu.mig_enabled:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if gi_id not in gpu.instances:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._handle(pynvml.c_nvmlGpuInstance_t, ("gi", index, gi_id))

    def nvmlGpuInstanceGetComputeInstanceById(self, gi_handle: Any, ci_id: int) -> Any:
        index, gpu, gi_id = self._gi("nvmlGpuInstanceGetComputeInstanceById", gi_handle)
        if ci_id not in gpu.instances[gi_id][3]:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._handle(pynvml.c_nvmlComputeInstance_t, ("ci", index, gi_id, ci_id))

    def nvmlComputeInstanceDestroy(self, ci_handle: Any) -> int:
        self._enter("nvmlComputeInstanceDestroy")
        _, index, gi_id, ci_id = self._resolve(ci_handle)
        gpu = self.gpus[index]
        if any(p.gpuInstanceId == gi_id for p in gpu.processes):
            raise _error(pynvml.NVML_ERROR_IN_USE)
        gpu.instances[gi_id][3].remove(ci_id)
        return pynvml.NVML_SUCCESS

    def nvmlGpuInstanceDestroy(self, gi_handle: Any) -> int:
        _, gpu, gi_id = self._gi("nvmlGpuInstanceDestroy", gi_handle)
        if gpu.instances[gi_id][3] or any(p.gpuInstanceId == gi_id for p in gpu.processes):
            raise _error(pynvml.NVML_ERROR_IN_USE)
        del gpu.instances[gi_id]
        return pynvml.NVML_SUCCESS

    # -- compute mode --------------------------------------------------------------------

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        return self._gpu("nvmlDeviceGetComputeMode", handle)[1].compute_mode

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> None:
        self._gpu("nvmlDeviceSetComputeMode", handle)[1].compute_mode = mode

    # -- events --------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        with self._event_ready:
            self._event_sets.append(FakeEventSet(read=len(self._events)))
            return self._handle(pynvml.c_nvmlEventSet_t, ("eventset", len(self._event_sets) - 1))

    def _event_set(self, handle: Any) -> FakeEventSet:
        target = self._resolve(handle)
        if not (isinstance(target, tuple) and target[0] == "eventset"):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        event_set = self._event_sets[target[1]]
        if event_set.freed:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._gpu("nvmlDeviceGetSupportedEventTypes", handle)
        return pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        index, _ = self._gpu("nvmlDeviceRegisterEvents", handle)
        self._event_set(event_set).registered.add(index)

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        """As NVML: events raised for the set's GPUs first; then, while a GPU registered in
        the set is lost, GPU_IS_LOST at once on every call, naming no GPU."""
        self._enter("nvmlEventSetWait")
        waited = self._event_set(event_set)

        def lost() -> bool:
            return self.wait_answers_lost or any(self.gpus[i].lost for i in waited.registered)

        def next_event() -> tuple[int, int] | None:
            while waited.read < len(self._events):
                index, xid = self._events[waited.read]
                waited.read += 1
                if index in waited.registered:
                    return index, xid
            return None

        with self._event_ready:
            event: tuple[int, int] | None = None

            def ready() -> bool:
                nonlocal event
                event = event or next_event()
                return event is not None or lost()

            self._event_ready.wait_for(ready, timeout=timeout_ms / 1000)
            if event is None:
                raise _error(pynvml.NVML_ERROR_GPU_IS_LOST if lost() else pynvml.NVML_ERROR_TIMEOUT)
        data = pynvml.c_nvmlEventData_t()
        data.device = self._handle(pynvml.c_nvmlDevice_t, ("gpu", event[0]))
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = event[1]
        data.gpuInstanceId = NO_INSTANCE
        data.computeInstanceId = NO_INSTANCE
        return data

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self._enter("nvmlEventSetFree")
        with self._event_ready:
            self._event_set(event_set).freed = True

    # -- processes -----------------------------------------------------------------------

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        return list(self._gpu("nvmlDeviceGetComputeRunningProcesses", handle)[1].processes)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, since: int) -> list[Any]:
        gpu = self._gpu("nvmlDeviceGetProcessUtilization", handle)[1]
        samples = []
        for process in gpu.processes:
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp = process.pid, 1_700_000_000_000_000
            sample.smUtil, sample.memUtil = process.sm_util, process.mem_util
            if sample.timeStamp > since:
                samples.append(sample)
        if not samples:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return samples


def fake_process(
    pid: int, used_mib: int, gpu_instance_id: int = NO_INSTANCE, sm: int = 0, mem: int = 0
) -> SimpleNamespace:
    """A process as ``nvmlDeviceGetComputeRunningProcesses`` returns it."""
    ci = 0 if gpu_instance_id != NO_INSTANCE else NO_INSTANCE
    return SimpleNamespace(
        pid=pid,
        usedGpuMemory=used_mib * MIB,
        gpuInstanceId=gpu_instance_id,
        computeInstanceId=ci,
        sm_util=sm,
        mem_util=mem,
    )
