"""MIG through NVML: mode, profiles and their placements, and MIG devices (a GPU instance
with one compute instance spanning it) created, listed and destroyed."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import pynvml

from flexgpu.driver.backend_errors import (
    GpuBackendError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
)
from flexgpu.driver.gpu_model import (
    MigDevice,
    MigEngines,
    MigMode,
    MigPlacement,
    MigProfile,
)
from flexgpu.driver.nvml_calls import NvmlCalls, nvml_text
from flexgpu.driver.nvml_errors import error_for_code

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


class NvmlMig(NvmlCalls):
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
            name=nvml_text(info.name).removeprefix("MIG "),
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
        current, _ = self._call("nvmlDeviceGetMigMode", handle, context=f"MIG on GPU {index}")
        # Read once per GPU and mode: a GPU's profiles follow from its model and MIG mode, and
        # reading them costs every prepare that creates a partition about 30 NVML calls.
        key = (
            nvml_text(self._call("nvmlDeviceGetUUID", handle)),
            current == pynvml.NVML_DEVICE_MIG_ENABLE,
        )
        cached = self._mig_profile_cache.get(key)
        if cached is None:
            profiles = [self._profile(handle, info) for info in self._profile_infos(handle)]
            # NVML lists profiles in its enum order; smallest first, as the simulated catalog
            # lists them, keeps listings and published devices in the same order on either
            # backend.
            profiles.sort(key=lambda p: (p.memory_slices, p.compute_slices, p.name))
            cached = self._mig_profile_cache[key] = tuple(profiles)
        return list(cached)

    def mig_profiles(self, index: int) -> list[MigProfile]:
        with self._lock:
            return self._mig_profiles(self._handle(index), index)

    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        with self._lock:
            handle = self._handle(index)
            for profile in self._mig_profiles(handle, index):
                if profile.profile_id == profile_id:
                    return list(profile.placements)
            return self._placements(handle, profile_id)  # NVML says what is wrong with it

    def _mig_handles(self, handle: Any) -> dict[int, list[tuple[int, str]]]:
        """GPU instance id -> (compute instance id, MIG UUID) of every MIG device."""
        found: dict[int, list[tuple[int, str]]] = {}
        for gi_id, mig in self._mig_device_handles(handle):
            ci_id = int(self._call("nvmlDeviceGetComputeInstanceId", mig))
            found.setdefault(gi_id, []).append(
                (ci_id, nvml_text(self._call("nvmlDeviceGetUUID", mig)))
            )
        return found

    def _mig_uuid(self, handle: Any, gi_id: int, ci_id: int) -> str | None:
        """The UUID of one MIG device, found without reading every other one's."""
        for found_gi, mig in self._mig_device_handles(handle):
            if (
                found_gi == gi_id
                and int(self._call("nvmlDeviceGetComputeInstanceId", mig)) == ci_id
            ):
                return nvml_text(self._call("nvmlDeviceGetUUID", mig))
        return None

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
            uuid = self._mig_uuid(handle, gi_id, ci_id)
            return MigDevice(
                parent_index=index,
                parent_uuid=nvml_text(self._call("nvmlDeviceGetUUID", handle)),
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
            parent_uuid = nvml_text(self._call("nvmlDeviceGetUUID", handle))
            mig_handles = self._mig_handles(handle)
            devices: list[MigDevice] = []
            for profile in self._mig_profiles(handle, index):
                array = (pynvml.c_nvmlGpuInstance_t * profile.max_instances)()
                count = ctypes.c_uint(0)
                self._call(
                    "nvmlDeviceGetGpuInstances",
                    handle,
                    profile.profile_id,
                    array,
                    ctypes.byref(count),
                )
                for slot in range(count.value):
                    gi_info = self._call("nvmlGpuInstanceGetInfo", array[slot])
                    gi_id = int(gi_info.id)
                    compute = mig_handles.get(gi_id, [])
                    devices.append(
                        MigDevice(
                            parent_index=index,
                            parent_uuid=parent_uuid,
                            profile_id=profile.profile_id,
                            profile_name=profile.name,
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
