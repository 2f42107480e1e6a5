"""A stand-in for the ``pynvml`` module holding the state of simulated hardware.

Only for NVML error paths the NVML mock library (tools/nvml-mock) cannot produce, such as a
call failing with a code the library never returns there, or a GPU lost in the middle of one
enumeration; every other NVML backend test runs the real pynvml module over that library.
It offers the same functions the real module does, with the same argument conventions (ctypes
arrays and ``byref`` counts filled in place, opaque ctypes handles) and raises the real
``pynvml.NVMLError`` subclasses with NVML's codes, so ``NvmlBackend`` runs unchanged against it.
Figures are what NVML reports on the products modelled (A100-SXM4-80GB with driver 580, T4).
Anything not defined here falls through to the real module (constants, structures, errors).
The simulated hardware is in fake_gpus.py, the MIG functions in fake_nvml_mig.py.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace
from typing import Any

import pynvml
from fake_gpus import (
    MIB,
    NO_INSTANCE,
    FakeEventSet,
    FakeGpu,
    FakeProfile,
    _error,
    a100_80gb,
    t4,
)
from fake_nvml_mig import FakeNvmlMig

__all__ = ["FakeGpu", "FakeNvml", "FakeProfile", "a100_80gb", "t4"]


class FakeNvml(FakeNvmlMig):
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
