"""The MIG part of fake_pynvml.FakeNvml: mode, GPU instance profiles and placements, GPU and
compute instances, MIG device handles, answered from the simulated GPUs' state as NVML does."""

from __future__ import annotations

from typing import Any

import pynvml
from fake_gpus import CI_PROFILE_IDS, FakeGpu, _deref, _error, _gpu_instance_id


class FakeNvmlMig:
    """Mixed into FakeNvml, whose handle plumbing (``_gpu``, ``_mig_gpu``, ``_gi``,
    ``_handle``, ``_resolve``, ``_enter``) it uses."""

    gpus: list[FakeGpu]

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
