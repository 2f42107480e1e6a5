package main

// NVML's MIG entry points. Profiles, placements and compute-instance profiles come from NVIDIA's
// mock tables; the rules a driver enforces when instances are created and destroyed (placement
// in the published list, no overlap, per-profile instance limit, MIG mode, busy instances) and
// the instances themselves live here, in the shared state.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#cgo CFLAGS: -I${SRCDIR}
#include "nvml_exports.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
)

// migDevice resolves a GPU handle and checks it can do MIG at all.
func (ss *session) migGpu(device C.nvmlDevice_t) (*gpu, nvml.Return) {
	g, r := ss.device(devicePtr(device))
	if r != nvml.SUCCESS {
		return nil, r
	}
	if !g.migCapable() {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	return g, nvml.SUCCESS
}

// migEnabled is migGpu for calls that need MIG mode on.
func (ss *session) migEnabled(device C.nvmlDevice_t) (*gpu, nvml.Return) {
	g, r := ss.migGpu(device)
	if r != nvml.SUCCESS {
		return nil, r
	}
	if ss.st(g).MigMode != C.NVML_DEVICE_MIG_ENABLE {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	return g, nvml.SUCCESS
}

//export nvmlDeviceGetMigMode
func nvmlDeviceGetMigMode(device C.nvmlDevice_t, current *C.uint, pending *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migGpu(device)
		if r != nvml.SUCCESS {
			return r
		}
		*current = C.uint(ss.st(g).MigMode)
		*pending = C.uint(ss.st(g).MigMode)
		return nvml.SUCCESS
	})
}

// nvmlDeviceSetMigMode applies at once, as on GPUs that need no reset for it.
//
//export nvmlDeviceSetMigMode
func nvmlDeviceSetMigMode(device C.nvmlDevice_t, mode C.uint, activation *C.nvmlReturn_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migGpu(device)
		if r != nvml.SUCCESS {
			return r
		}
		if mode != C.NVML_DEVICE_MIG_ENABLE && mode != C.NVML_DEVICE_MIG_DISABLE {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		st := ss.st(g)
		if mode == C.NVML_DEVICE_MIG_DISABLE && len(st.GpuInstances) > 0 {
			return nvml.ERROR_IN_USE
		}
		st.MigMode = int(mode)
		ss.changed = true
		if activation != nil {
			*activation = C.NVML_SUCCESS
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstanceProfileInfo
func nvmlDeviceGetGpuInstanceProfileInfo(device C.nvmlDevice_t, profile C.uint, out *C.nvmlGpuInstanceProfileInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migGpu(device)
		if r != nvml.SUCCESS {
			return r
		}
		info, _, r := g.profileByIndex(int(profile))
		if r != nvml.SUCCESS {
			return r
		}
		fillProfileV1(out, info)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstanceProfileInfoV
func nvmlDeviceGetGpuInstanceProfileInfoV(device C.nvmlDevice_t, profile C.uint, out *C.nvmlGpuInstanceProfileInfo_v2_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if out == nil || out.version != gpuInstanceProfileInfoV2 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		g, r := ss.migEnabled(device) // nvml.h: NOT_SUPPORTED while MIG mode is off
		if r != nvml.SUCCESS {
			return r
		}
		info, name, r := g.profileByIndex(int(profile))
		if r != nvml.SUCCESS {
			return r
		}
		fillProfileV2(out, info, name)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstancePossiblePlacements_v2
func nvmlDeviceGetGpuInstancePossiblePlacements_v2(device C.nvmlDevice_t, profileID C.uint, placements *C.nvmlGpuInstancePlacement_t, count *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migGpu(device) // nvml.h: needs MIG support, not MIG mode
		if r != nvml.SUCCESS {
			return r
		}
		index, _, _, ok := g.profileByID(int(profileID))
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		possible := g.placements(index)
		if placements == nil {
			*count = C.uint(len(possible))
			return nvml.SUCCESS
		}
		if int(*count) < len(possible) {
			*count = C.uint(len(possible))
			return nvml.ERROR_INSUFFICIENT_SIZE
		}
		out := unsafe.Slice(placements, len(possible))
		for i, p := range possible {
			out[i].start, out[i].size = C.uint(p.Start), C.uint(p.Size)
		}
		*count = C.uint(len(possible))
		return nvml.SUCCESS
	})
}

func giPointer(g *gpu, id int) C.nvmlGpuInstance_t {
	return instanceHandle(pointerFor(handle{kind: kindGpuInstance, uuid: g.uuid, gi: id}))
}

//export nvmlDeviceCreateGpuInstanceWithPlacement
func nvmlDeviceCreateGpuInstanceWithPlacement(device C.nvmlDevice_t, profileID C.uint, placement *C.nvmlGpuInstancePlacement_t, out *C.nvmlGpuInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migEnabled(device)
		if r != nvml.SUCCESS {
			return r
		}
		if placement == nil || out == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		index, info, _, ok := g.profileByID(int(profileID))
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		start, size := int(placement.start), int(placement.size)
		allowed := false
		for _, p := range g.placements(index) {
			allowed = allowed || (int(p.Start) == start && int(p.Size) == size)
		}
		if !allowed {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		st := ss.st(g)
		same := 0
		for _, other := range st.GpuInstances {
			if start < other.Start+other.Size && other.Start < start+size {
				return nvml.ERROR_INSUFFICIENT_RESOURCES
			}
			if other.ProfileIndex == index {
				same++
			}
		}
		if same >= int(info.InstanceCount) {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id := 1 // NVML numbers GPU instances from 1; reuse the lowest free id
		for ss.gpuInstance(g, id) != nil {
			id++
		}
		st.GpuInstances = append(st.GpuInstances, gpuInstance{ID: id, ProfileIndex: index, Start: start, Size: size})
		ss.changed = true
		*out = giPointer(g, id)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstances
func nvmlDeviceGetGpuInstances(device C.nvmlDevice_t, profileID C.uint, instances *C.nvmlGpuInstance_t, count *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migEnabled(device)
		if r != nvml.SUCCESS {
			return r
		}
		index, info, _, ok := g.profileByID(int(profileID))
		if !ok || instances == nil || count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		out := unsafe.Slice(instances, int(info.InstanceCount))
		n := 0
		for _, gi := range ss.st(g).GpuInstances {
			if gi.ProfileIndex == index && n < len(out) {
				out[n] = giPointer(g, gi.ID)
				n++
			}
		}
		*count = C.uint(n)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstanceById
func nvmlDeviceGetGpuInstanceById(device C.nvmlDevice_t, id C.uint, out *C.nvmlGpuInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migEnabled(device)
		if r != nvml.SUCCESS {
			return r
		}
		if ss.gpuInstance(g, int(id)) == nil {
			return nvml.ERROR_NOT_FOUND
		}
		*out = giPointer(g, int(id))
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceGetInfo
func nvmlGpuInstanceGetInfo(instance C.nvmlGpuInstance_t, out *C.nvmlGpuInstanceInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		info, _, _ := g.profileByIndex(gi.ProfileIndex)
		out.device = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: g.uuid}))
		out.id = C.uint(gi.ID)
		out.profileId = C.uint(info.Id)
		out.placement.start, out.placement.size = C.uint(gi.Start), C.uint(gi.Size)
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceDestroy
func nvmlGpuInstanceDestroy(instance C.nvmlGpuInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		if len(gi.ComputeInstances) > 0 || ss.busy(g, gi.ID, -1) {
			return nvml.ERROR_IN_USE
		}
		st := ss.st(g)
		kept := st.GpuInstances[:0]
		for _, other := range st.GpuInstances {
			if other.ID != gi.ID {
				kept = append(kept, other)
			}
		}
		st.GpuInstances = kept
		ss.changed = true
		return nvml.SUCCESS
	})
}

func computeProfileFor(g *gpu, gi *gpuInstance, profile, engine int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	info, r := g.computeProfile(gi.ProfileIndex, profile, engine)
	if r != nvml.SUCCESS {
		return info, r
	}
	info.Id = uint32(profile) // compute-instance profile ids are the enum values in NVML too
	return info, nvml.SUCCESS
}

//export nvmlGpuInstanceGetComputeInstanceProfileInfo
func nvmlGpuInstanceGetComputeInstanceProfileInfo(instance C.nvmlGpuInstance_t, profile C.uint, engine C.uint, out *C.nvmlComputeInstanceProfileInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		info, r := computeProfileFor(g, gi, int(profile), int(engine))
		if r != nvml.SUCCESS {
			return r
		}
		out.id = C.uint(info.Id)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.sharedCopyEngineCount = C.uint(info.SharedCopyEngineCount)
		out.sharedDecoderCount = C.uint(info.SharedDecoderCount)
		out.sharedEncoderCount = C.uint(info.SharedEncoderCount)
		out.sharedJpegCount = C.uint(info.SharedJpegCount)
		out.sharedOfaCount = C.uint(info.SharedOfaCount)
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceGetComputeInstanceProfileInfoV
func nvmlGpuInstanceGetComputeInstanceProfileInfoV(instance C.nvmlGpuInstance_t, profile C.uint, engine C.uint, out *C.nvmlComputeInstanceProfileInfo_v2_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if out == nil || out.version != computeInstanceProfileInfoV2 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		info, r := computeProfileFor(g, gi, int(profile), int(engine))
		if r != nvml.SUCCESS {
			return r
		}
		out.id = C.uint(info.Id)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.sharedCopyEngineCount = C.uint(info.SharedCopyEngineCount)
		out.sharedDecoderCount = C.uint(info.SharedDecoderCount)
		out.sharedEncoderCount = C.uint(info.SharedEncoderCount)
		out.sharedJpegCount = C.uint(info.SharedJpegCount)
		out.sharedOfaCount = C.uint(info.SharedOfaCount)
		_, giName, _ := g.profileByIndex(gi.ProfileIndex)
		name := fmt.Sprintf("MIG %dc.%s", info.SliceCount, strings.TrimPrefix(giName, "MIG "))
		fillArray(&out.name[0], len(out.name), name)
		return nvml.SUCCESS
	})
}

func ciPointer(g *gpu, gi, ci int) C.nvmlComputeInstance_t {
	return computeHandle(pointerFor(handle{kind: kindComputeInstance, uuid: g.uuid, gi: gi, ci: ci}))
}

//export nvmlGpuInstanceCreateComputeInstance
func nvmlGpuInstanceCreateComputeInstance(instance C.nvmlGpuInstance_t, profile C.uint, out *C.nvmlComputeInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		info, r := computeProfileFor(g, gi, int(profile), nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if r != nvml.SUCCESS {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		giInfo, _, _ := g.profileByIndex(gi.ProfileIndex)
		used := 0
		for _, ci := range gi.ComputeInstances {
			other, _ := computeProfileFor(g, gi, ci.ProfileIndex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			used += int(other.SliceCount)
		}
		if used+int(info.SliceCount) > int(giInfo.SliceCount) {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		id := 0 // NVML numbers compute instances from 0 inside their GPU instance
		for {
			if _, ci := ss.computeInstance(g, gi.ID, id); ci == nil {
				break
			}
			id++
		}
		gi.ComputeInstances = append(gi.ComputeInstances, computeInstance{
			ID: id, ProfileIndex: int(profile), UUID: "MIG-" + uuid.NewString(),
		})
		ss.changed = true
		if out != nil {
			*out = ciPointer(g, gi.ID, id)
		}
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceGetComputeInstanceById
func nvmlGpuInstanceGetComputeInstanceById(instance C.nvmlGpuInstance_t, id C.uint, out *C.nvmlComputeInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, r := ss.instanceOf(instancePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		if _, ci := ss.computeInstance(g, gi.ID, int(id)); ci == nil {
			return nvml.ERROR_NOT_FOUND
		}
		*out = ciPointer(g, gi.ID, int(id))
		return nvml.SUCCESS
	})
}

func (ss *session) computeOf(p unsafe.Pointer) (*gpu, *gpuInstance, *computeInstance, nvml.Return) {
	h, ok := handleAt(p, kindComputeInstance)
	if !ok {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := ss.byUUID(h.uuid)
	if g == nil {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if ss.st(g).Lost {
		return nil, nil, nil, nvml.ERROR_GPU_IS_LOST
	}
	gi, ci := ss.computeInstance(g, h.gi, h.ci)
	if ci == nil {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, gi, ci, nvml.SUCCESS
}

//export nvmlComputeInstanceGetInfo_v2
func nvmlComputeInstanceGetInfo_v2(instance C.nvmlComputeInstance_t, out *C.nvmlComputeInstanceInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, ci, r := ss.computeOf(computePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		info, _ := computeProfileFor(g, gi, ci.ProfileIndex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		out.device = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: g.uuid}))
		out.gpuInstance = giPointer(g, gi.ID)
		out.id = C.uint(ci.ID)
		out.profileId = C.uint(ci.ProfileIndex)
		out.placement.start, out.placement.size = 0, C.uint(info.SliceCount)
		return nvml.SUCCESS
	})
}

//export nvmlComputeInstanceDestroy
func nvmlComputeInstanceDestroy(instance C.nvmlComputeInstance_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, gi, ci, r := ss.computeOf(computePtr(instance))
		if r != nvml.SUCCESS {
			return r
		}
		if ss.busy(g, gi.ID, ci.ID) {
			return nvml.ERROR_IN_USE
		}
		kept := gi.ComputeInstances[:0]
		for _, other := range gi.ComputeInstances {
			if other.ID != ci.ID {
				kept = append(kept, other)
			}
		}
		gi.ComputeInstances = kept
		ss.changed = true
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetMaxMigDeviceCount
func nvmlDeviceGetMaxMigDeviceCount(device C.nvmlDevice_t, count *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		*count = C.uint(g.maxMigDevices())
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetMigDeviceHandleByIndex
func nvmlDeviceGetMigDeviceHandleByIndex(device C.nvmlDevice_t, index C.uint, out *C.nvmlDevice_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.migEnabled(device)
		if r != nvml.SUCCESS {
			return r
		}
		if int(index) >= g.maxMigDevices() {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		devices := ss.migDevices(g)
		if int(index) >= len(devices) {
			return nvml.ERROR_NOT_FOUND
		}
		*out = deviceHandle(pointerFor(devices[index]))
		return nvml.SUCCESS
	})
}

func (ss *session) migHandle(device C.nvmlDevice_t) (*handle, nvml.Return) {
	if _, ok := handleAt(devicePtr(device), kindDevice); ok {
		return nil, nvml.ERROR_NOT_SUPPORTED // a whole GPU has no instance ids
	}
	_, h, r := ss.anyDevice(devicePtr(device))
	return h, r
}

//export nvmlDeviceGetGpuInstanceId
func nvmlDeviceGetGpuInstanceId(device C.nvmlDevice_t, id *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		h, r := ss.migHandle(device)
		if r != nvml.SUCCESS {
			return r
		}
		*id = C.uint(h.gi)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetComputeInstanceId
func nvmlDeviceGetComputeInstanceId(device C.nvmlDevice_t, id *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		h, r := ss.migHandle(device)
		if r != nvml.SUCCESS {
			return r
		}
		*id = C.uint(h.ci)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceIsMigDeviceHandle
func nvmlDeviceIsMigDeviceHandle(device C.nvmlDevice_t, isMig *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		_, h, r := ss.anyDevice(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		*isMig = 0
		if h != nil {
			*isMig = 1
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetDeviceHandleFromMigDeviceHandle
func nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device C.nvmlDevice_t, out *C.nvmlDevice_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		h, r := ss.migHandle(device)
		if r != nvml.SUCCESS {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*out = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: h.uuid}))
		return nvml.SUCCESS
	})
}
