package main

// NVML entry points that find a device by identity (UUID, PCI bus id) and the platform's
// answers about a device (addressing mode, virtualization mode) that NVIDIA's own DRA kubelet
// plugin reads while it enumerates GPUs.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#cgo CFLAGS: -I${SRCDIR}
#include "nvml_exports.h"
*/
import "C"

import (
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nvmlDeviceGetHandleByUUID accepts a GPU's UUID or a MIG device's (MIG-...), as NVML does.
//
//export nvmlDeviceGetHandleByUUID
func nvmlDeviceGetHandleByUUID(uuid *C.char, device *C.nvmlDevice_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if uuid == nil || device == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		wanted := C.GoString(uuid)
		for _, g := range ss.visible() {
			if g.uuid == wanted {
				if ss.st(g).Lost {
					return nvml.ERROR_GPU_IS_LOST
				}
				*device = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: g.uuid}))
				return nvml.SUCCESS
			}
			for _, mig := range ss.migDevices(g) {
				if _, ci := ss.computeInstance(g, mig.gi, mig.ci); ci != nil && ci.UUID == wanted {
					*device = deviceHandle(pointerFor(mig))
					return nvml.SUCCESS
				}
			}
		}
		return nvml.ERROR_NOT_FOUND
	})
}

// nvmlDeviceGetHandleByPciBusId_v2 takes the bus id in any of the forms NVML accepts
// (a 4- or 8-digit domain), compared as numbers.
//
//export nvmlDeviceGetHandleByPciBusId_v2
func nvmlDeviceGetHandleByPciBusId_v2(busID *C.char, device *C.nvmlDevice_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if busID == nil || device == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		domain, bus, slot, err := parseBusID(C.GoString(busID))
		if err != nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		for _, g := range ss.visible() {
			if g.domain == domain && g.bus == bus && g.slot == slot {
				if ss.st(g).Lost {
					return nvml.ERROR_GPU_IS_LOST
				}
				*device = deviceHandle(pointerFor(handle{kind: kindDevice, uuid: g.uuid}))
				return nvml.SUCCESS
			}
		}
		return nvml.ERROR_NOT_FOUND
	})
}

// nvmlDeviceGetAddressingMode reports the machine's addressingMode; a machine that sets none
// answers NOT_SUPPORTED, as NVML does where the platform offers neither HMM nor ATS.
//
//export nvmlDeviceGetAddressingMode
func nvmlDeviceGetAddressingMode(device C.nvmlDevice_t, mode *C.nvmlDeviceAddressingMode_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if _, r := ss.device(devicePtr(device)); r != nvml.SUCCESS {
			return r
		}
		if mode == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if mode.version != deviceAddressingModeV1 {
			return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
		}
		if ss.m.addressingMode == nil {
			return nvml.ERROR_NOT_SUPPORTED
		}
		mode.value = C.uint(*ss.m.addressingMode)
		return nvml.SUCCESS
	})
}

// nvmlDeviceGetVirtualizationMode: the mock machines are bare metal, no vGPU or passthrough host.
//
//export nvmlDeviceGetVirtualizationMode
func nvmlDeviceGetVirtualizationMode(device C.nvmlDevice_t, mode *C.nvmlGpuVirtualizationMode_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if _, r := ss.device(devicePtr(device)); r != nvml.SUCCESS {
			return r
		}
		if mode == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		*mode = C.NVML_GPU_VIRTUALIZATION_MODE_NONE
		return nvml.SUCCESS
	})
}
