package main

// NVML entry points: library lifetime, system queries, GPU enumeration and identity, NVLink,
// compute mode, processes. Prototypes come from nvml.h; cgo rejects any export that differs.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#cgo CFLAGS: -I${SRCDIR}
#include "nvml_exports.h"
*/
import "C"

import (
	"fmt"
	"sort"
	"strconv"
	"sync"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

//export nvmlInit_v2
func nvmlInit_v2() C.nvmlReturn_t { return ret(initialise()) }

//export nvmlInit
func nvmlInit() C.nvmlReturn_t { return ret(initialise()) }

//export nvmlInitWithFlags
func nvmlInitWithFlags(flags C.uint) C.nvmlReturn_t { return ret(initialise()) }

//export nvmlShutdown
func nvmlShutdown() C.nvmlReturn_t { return ret(shutdown()) }

var errorStrings sync.Map // nvml.Return -> *C.char, allocated once and never freed

//export nvmlErrorString
func nvmlErrorString(result C.nvmlReturn_t) *C.char {
	code := nvml.Return(result)
	if text, ok := errorStrings.Load(code); ok {
		return text.(*C.char)
	}
	text := C.CString(errorText(code))
	actual, _ := errorStrings.LoadOrStore(code, text)
	return actual.(*C.char)
}

func errorText(code nvml.Return) string {
	texts := map[nvml.Return]string{
		nvml.SUCCESS:                         "Success",
		nvml.ERROR_UNINITIALIZED:             "Uninitialized",
		nvml.ERROR_INVALID_ARGUMENT:          "Invalid Argument",
		nvml.ERROR_NOT_SUPPORTED:             "Not Supported",
		nvml.ERROR_NO_PERMISSION:             "Insufficient Permissions",
		nvml.ERROR_NOT_FOUND:                 "Not Found",
		nvml.ERROR_INSUFFICIENT_SIZE:         "Insufficient Size",
		nvml.ERROR_DRIVER_NOT_LOADED:         "Driver Not Loaded",
		nvml.ERROR_TIMEOUT:                   "Timeout",
		nvml.ERROR_GPU_IS_LOST:               "GPU is lost",
		nvml.ERROR_IN_USE:                    "In use by another client",
		nvml.ERROR_INSUFFICIENT_RESOURCES:    "Insufficient resources",
		nvml.ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
		nvml.ERROR_UNKNOWN:                   "Unknown Error",
	}
	if text, ok := texts[code]; ok {
		return text
	}
	return "Unknown Error " + strconv.Itoa(int(code))
}

//export nvmlSystemGetDriverVersion
func nvmlSystemGetDriverVersion(version *C.char, length C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return { return copyString(version, length, ss.m.driverVersion) })
}

//export nvmlSystemGetNVMLVersion
func nvmlSystemGetNVMLVersion(version *C.char, length C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		return copyString(version, length, fmt.Sprintf("%d.%s", ss.m.cudaVersion/1000, ss.m.driverVersion))
	})
}

//export nvmlSystemGetCudaDriverVersion
func nvmlSystemGetCudaDriverVersion(version *C.int) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		*version = C.int(ss.m.cudaVersion)
		return nvml.SUCCESS
	})
}

//export nvmlSystemGetCudaDriverVersion_v2
func nvmlSystemGetCudaDriverVersion_v2(version *C.int) C.nvmlReturn_t {
	return nvmlSystemGetCudaDriverVersion(version)
}

//export nvmlDeviceGetCount_v2
func nvmlDeviceGetCount_v2(count *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*count = C.uint(len(ss.visible()))
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetHandleByIndex_v2
func nvmlDeviceGetHandleByIndex_v2(index C.uint, device *C.nvmlDevice_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		seen := ss.visible()
		if device == nil || int(index) >= len(seen) {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*device = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: seen[index].uuid}))
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetIndex
func nvmlDeviceGetIndex(device C.nvmlDevice_t, index *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		for i, v := range ss.visible() {
			if v == g {
				*index = C.uint(i)
			}
		}
		return nvml.SUCCESS
	})
}

// withAnyDevice resolves a GPU or MIG device handle: MIG devices answer identity queries with
// their parent's figures except where NVML says otherwise.
func (ss *session) anyDevice(p unsafe.Pointer) (*gpu, *handle, nvml.Return) {
	if h, ok := handleAt(p, kindMigDevice); ok {
		g := ss.byUUID(h.uuid)
		if g == nil {
			return nil, nil, nvml.ERROR_INVALID_ARGUMENT
		}
		if ss.st(g).Lost {
			return nil, nil, nvml.ERROR_GPU_IS_LOST
		}
		if _, ci := ss.computeInstance(g, h.gi, h.ci); ci == nil {
			return nil, nil, nvml.ERROR_INVALID_ARGUMENT
		}
		return g, h, nvml.SUCCESS
	}
	g, r := ss.device(p)
	return g, nil, r
}

//export nvmlDeviceGetUUID
func nvmlDeviceGetUUID(device C.nvmlDevice_t, out *C.char, length C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, mig, r := ss.anyDevice(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		if mig != nil {
			_, ci := ss.computeInstance(g, mig.gi, mig.ci)
			return copyString(out, length, ci.UUID)
		}
		return copyString(out, length, g.uuid)
	})
}

//export nvmlDeviceGetName
func nvmlDeviceGetName(device C.nvmlDevice_t, out *C.char, length C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		name, r := g.device.GetName()
		if r != nvml.SUCCESS {
			return r
		}
		return copyString(out, length, name)
	})
}

//export nvmlDeviceGetBrand
func nvmlDeviceGetBrand(device C.nvmlDevice_t, brand *C.nvmlBrandType_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		value, r := g.device.GetBrand()
		*brand = C.nvmlBrandType_t(value)
		return r
	})
}

//export nvmlDeviceGetArchitecture
func nvmlDeviceGetArchitecture(device C.nvmlDevice_t, arch *C.nvmlDeviceArchitecture_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		value, r := g.device.GetArchitecture()
		*arch = C.nvmlDeviceArchitecture_t(value)
		return r
	})
}

//export nvmlDeviceGetCudaComputeCapability
func nvmlDeviceGetCudaComputeCapability(device C.nvmlDevice_t, major *C.int, minor *C.int) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		a, b, r := g.device.GetCudaComputeCapability()
		*major, *minor = C.int(a), C.int(b)
		return r
	})
}

//export nvmlDeviceGetMemoryInfo
func nvmlDeviceGetMemoryInfo(device C.nvmlDevice_t, memory *C.nvmlMemory_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, mig, r := ss.anyDevice(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		total := uint64(0)
		if mig != nil {
			gi, _ := ss.computeInstance(g, mig.gi, mig.ci)
			info, _, _ := g.profileByIndex(gi.ProfileIndex)
			total = info.MemorySizeMB << 20
		} else {
			m, r := g.device.GetMemoryInfo()
			if r != nvml.SUCCESS {
				return r
			}
			total = m.Total
		}
		used := uint64(0)
		for _, p := range ss.st(g).Processes {
			if mig == nil || (p.GpuInstanceID != nil && *p.GpuInstanceID == mig.gi) {
				used += uint64(p.UsedMiB) << 20
			}
		}
		memory.total = C.ulonglong(total)
		memory.used = C.ulonglong(min(used, total))
		memory.free = C.ulonglong(total - min(used, total))
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetPciInfo_v3
func nvmlDeviceGetPciInfo_v3(device C.nvmlDevice_t, pci *C.nvmlPciInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		fillPci(pci, g)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetMinorNumber
func nvmlDeviceGetMinorNumber(device C.nvmlDevice_t, minor *C.uint) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		*minor = C.uint(g.minor)
		return nvml.SUCCESS
	})
}

// nvmlDeviceGetAttributes_v2 answers for MIG devices only: the mock has no multiprocessor count
// for a whole GPU, and many drivers report none either.
//
//export nvmlDeviceGetAttributes_v2
func nvmlDeviceGetAttributes_v2(device C.nvmlDevice_t, attributes *C.nvmlDeviceAttributes_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, mig, r := ss.anyDevice(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		if mig == nil {
			return nvml.ERROR_NOT_SUPPORTED
		}
		gi, ci := ss.computeInstance(g, mig.gi, mig.ci)
		info, _, _ := g.profileByIndex(gi.ProfileIndex)
		cp, r := g.computeProfile(gi.ProfileIndex, ci.ProfileIndex, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if r != nvml.SUCCESS {
			return r
		}
		attributes.multiprocessorCount = C.uint(cp.MultiprocessorCount)
		attributes.sharedCopyEngineCount = C.uint(cp.SharedCopyEngineCount)
		attributes.sharedDecoderCount = C.uint(cp.SharedDecoderCount)
		attributes.sharedEncoderCount = C.uint(cp.SharedEncoderCount)
		attributes.sharedJpegCount = C.uint(cp.SharedJpegCount)
		attributes.sharedOfaCount = C.uint(cp.SharedOfaCount)
		attributes.gpuInstanceSliceCount = C.uint(info.SliceCount)
		attributes.computeInstanceSliceCount = C.uint(cp.SliceCount)
		attributes.memorySizeMB = C.ulonglong(info.MemorySizeMB)
		return nvml.SUCCESS
	})
}

// -- NVLink: wiring comes from the machine description; the mock servers have none. ----------

func (ss *session) nvlink(device C.nvmlDevice_t, index C.uint) (*gpu, *link, nvml.Return) {
	g, r := ss.device(devicePtr(device))
	if r != nvml.SUCCESS {
		return nil, nil, r
	}
	if len(g.links) == 0 {
		return nil, nil, nvml.ERROR_NOT_SUPPORTED
	}
	if int(index) >= len(g.links) {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, &g.links[index], nvml.SUCCESS
}

//export nvmlDeviceGetNvLinkState
func nvmlDeviceGetNvLinkState(device C.nvmlDevice_t, index C.uint, active *C.nvmlEnableState_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		_, l, r := ss.nvlink(device, index)
		if r != nvml.SUCCESS {
			return r
		}
		*active = C.NVML_FEATURE_ENABLED
		if l.peer >= 0 && ss.st(ss.m.gpus[l.peer]).Lost {
			*active = C.NVML_FEATURE_DISABLED
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetNvLinkRemoteDeviceType
func nvmlDeviceGetNvLinkRemoteDeviceType(device C.nvmlDevice_t, index C.uint, kind *C.nvmlIntNvLinkDeviceType_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		_, l, r := ss.nvlink(device, index)
		if r != nvml.SUCCESS {
			return r
		}
		*kind = C.NVML_NVLINK_DEVICE_TYPE_GPU
		if l.peer < 0 {
			*kind = C.NVML_NVLINK_DEVICE_TYPE_SWITCH
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetNvLinkRemotePciInfo_v2
func nvmlDeviceGetNvLinkRemotePciInfo_v2(device C.nvmlDevice_t, index C.uint, pci *C.nvmlPciInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		_, l, r := ss.nvlink(device, index)
		if r != nvml.SUCCESS {
			return r
		}
		if l.peer < 0 {
			// An NVSwitch port: NVML reports no PCI address a GPU could match.
			*pci = C.nvmlPciInfo_t{}
			return nvml.SUCCESS
		}
		fillPci(pci, ss.m.gpus[l.peer])
		return nvml.SUCCESS
	})
}

// -- compute mode and processes: kept in the shared state, set by the test controls. ---------

//export nvmlDeviceGetComputeMode
func nvmlDeviceGetComputeMode(device C.nvmlDevice_t, mode *C.nvmlComputeMode_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		*mode = C.nvmlComputeMode_t(ss.st(g).ComputeMode)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceSetComputeMode
func nvmlDeviceSetComputeMode(device C.nvmlDevice_t, mode C.nvmlComputeMode_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		switch mode {
		case C.NVML_COMPUTEMODE_DEFAULT, C.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, C.NVML_COMPUTEMODE_PROHIBITED:
		default:
			return nvml.ERROR_INVALID_ARGUMENT
		}
		ss.st(g).ComputeMode = int(mode)
		ss.changed = true
		return nvml.SUCCESS
	})
}

const noInstance = 0xFFFFFFFF

//export nvmlDeviceGetComputeRunningProcesses_v3
func nvmlDeviceGetComputeRunningProcesses_v3(device C.nvmlDevice_t, count *C.uint, infos *C.nvmlProcessInfo_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, mig, r := ss.anyDevice(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		var procs []process
		for _, p := range ss.st(g).Processes {
			if mig == nil || (p.GpuInstanceID != nil && *p.GpuInstanceID == mig.gi) {
				procs = append(procs, p)
			}
		}
		capacity := int(*count)
		*count = C.uint(len(procs))
		if len(procs) == 0 {
			return nvml.SUCCESS
		}
		if infos == nil || capacity < len(procs) {
			return nvml.ERROR_INSUFFICIENT_SIZE
		}
		out := unsafe.Slice(infos, capacity)
		for i, p := range procs {
			out[i].pid = C.uint(p.Pid)
			out[i].usedGpuMemory = C.ulonglong(uint64(p.UsedMiB) << 20)
			out[i].gpuInstanceId, out[i].computeInstanceId = noInstance, noInstance
			if p.GpuInstanceID != nil {
				out[i].gpuInstanceId = C.uint(*p.GpuInstanceID)
				out[i].computeInstanceId = 0
			}
			if p.ComputeInstanceID != nil {
				out[i].computeInstanceId = C.uint(*p.ComputeInstanceID)
			}
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetProcessUtilization
func nvmlDeviceGetProcessUtilization(device C.nvmlDevice_t, samples *C.nvmlProcessUtilizationSample_t, count *C.uint, lastSeen C.ulonglong) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		var loaded []process
		for _, p := range ss.st(g).Processes {
			if p.SmUtil != nil && p.TimeStampUs > uint64(lastSeen) {
				loaded = append(loaded, p)
			}
		}
		sort.Slice(loaded, func(i, j int) bool { return loaded[i].Pid < loaded[j].Pid })
		if len(loaded) == 0 {
			return nvml.ERROR_NOT_FOUND // NVML's answer when no sample is newer than lastSeen
		}
		capacity := int(*count)
		*count = C.uint(len(loaded))
		if samples == nil || capacity < len(loaded) {
			return nvml.ERROR_INSUFFICIENT_SIZE
		}
		out := unsafe.Slice(samples, capacity)
		for i, p := range loaded {
			out[i] = C.nvmlProcessUtilizationSample_t{pid: C.uint(p.Pid), timeStamp: C.ulonglong(p.TimeStampUs)}
			out[i].smUtil = C.uint(*p.SmUtil)
			if p.MemUtil != nil {
				out[i].memUtil = C.uint(*p.MemUtil)
			}
		}
		return nvml.SUCCESS
	})
}

// nvmlDeviceGetUtilizationRates reports the capped sums of the sampled processes' SM and
// memory utilisation; like the real driver it has no device figure while MIG mode is on.
//
//export nvmlDeviceGetUtilizationRates
func nvmlDeviceGetUtilizationRates(device C.nvmlDevice_t, utilization *C.nvmlUtilization_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		if utilization == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if ss.st(g).MigMode == C.NVML_DEVICE_MIG_ENABLE {
			return nvml.ERROR_NOT_SUPPORTED
		}
		sm, mem := 0, 0
		for _, p := range ss.st(g).Processes {
			if p.SmUtil != nil {
				sm += *p.SmUtil
			}
			if p.MemUtil != nil {
				mem += *p.MemUtil
			}
		}
		utilization.gpu = C.uint(min(sm, 100))
		utilization.memory = C.uint(min(mem, 100))
		return nvml.SUCCESS
	})
}
