package main

// The C types of NVML's own header, and helpers that fill them. Every file with exports reads
// the header through nvml_exports.h, which renames the functions whose prototypes carry const
// qualifiers that Go exports cannot spell; their exports keep NVML's names and ABI.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#cgo CFLAGS: -I${SRCDIR}
#include "nvml_exports.h"
*/
import "C"

import (
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func ret(r nvml.Return) C.nvmlReturn_t { return C.nvmlReturn_t(r) }

// copyString writes s and its terminator into a caller buffer of length bytes.
func copyString(dst *C.char, length C.uint, s string) nvml.Return {
	if dst == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if uint(len(s))+1 > uint(length) {
		return nvml.ERROR_INSUFFICIENT_SIZE
	}
	buffer := unsafe.Slice((*byte)(unsafe.Pointer(dst)), int(length))
	copy(buffer, s)
	buffer[len(s)] = 0
	return nvml.SUCCESS
}

func fillArray(dst *C.char, size int, s string) {
	buffer := unsafe.Slice((*byte)(unsafe.Pointer(dst)), size)
	n := copy(buffer[:size-1], s)
	buffer[n] = 0
}

func fillPci(pci *C.nvmlPciInfo_t, g *gpu) {
	fillArray(&pci.busIdLegacy[0], len(pci.busIdLegacy), g.busIDLegacy())
	fillArray(&pci.busId[0], len(pci.busId), g.busID())
	pci.domain = C.uint(g.domain)
	pci.bus = C.uint(g.bus)
	pci.device = C.uint(g.slot)
	info, _ := g.device.GetPciInfo()
	pci.pciDeviceId = C.uint(info.PciDeviceId)
	pci.pciSubSystemId = C.uint(info.PciSubSystemId)
}

func fillProfileV1(out *C.nvmlGpuInstanceProfileInfo_t, info nvml.GpuInstanceProfileInfo) {
	out.id = C.uint(info.Id)
	out.isP2pSupported = C.uint(info.IsP2pSupported)
	out.sliceCount = C.uint(info.SliceCount)
	out.instanceCount = C.uint(info.InstanceCount)
	out.multiprocessorCount = C.uint(info.MultiprocessorCount)
	out.copyEngineCount = C.uint(info.CopyEngineCount)
	out.decoderCount = C.uint(info.DecoderCount)
	out.encoderCount = C.uint(info.EncoderCount)
	out.jpegCount = C.uint(info.JpegCount)
	out.ofaCount = C.uint(info.OfaCount)
	out.memorySizeMB = C.ulonglong(info.MemorySizeMB)
}

func fillProfileV2(out *C.nvmlGpuInstanceProfileInfo_v2_t, info nvml.GpuInstanceProfileInfo, name string) {
	out.id = C.uint(info.Id)
	out.isP2pSupported = C.uint(info.IsP2pSupported)
	out.sliceCount = C.uint(info.SliceCount)
	out.instanceCount = C.uint(info.InstanceCount)
	out.multiprocessorCount = C.uint(info.MultiprocessorCount)
	out.copyEngineCount = C.uint(info.CopyEngineCount)
	out.decoderCount = C.uint(info.DecoderCount)
	out.encoderCount = C.uint(info.EncoderCount)
	out.jpegCount = C.uint(info.JpegCount)
	out.ofaCount = C.uint(info.OfaCount)
	out.memorySizeMB = C.ulonglong(info.MemorySizeMB)
	fillArray(&out.name[0], len(out.name), name)
}

// Struct versions as NVML_STRUCT_VERSION builds them: size in the low 24 bits, version above.
var (
	gpuInstanceProfileInfoV2     = C.uint(unsafe.Sizeof(C.nvmlGpuInstanceProfileInfo_v2_t{})) | 2<<24
	computeInstanceProfileInfoV2 = C.uint(unsafe.Sizeof(C.nvmlComputeInstanceProfileInfo_v2_t{})) | 2<<24
	deviceAddressingModeV1       = C.uint(unsafe.Sizeof(C.nvmlDeviceAddressingMode_v1_t{})) | 1<<24
)

// go-nvml's copy of nvml.h wraps each opaque handle in a struct of one pointer; that struct is
// passed and returned exactly as the bare pointer of NVIDIA's header is, so the ABI is NVML's.
func devicePtr(d C.nvmlDevice_t) unsafe.Pointer { return unsafe.Pointer(d.handle) }

func deviceHandle(p unsafe.Pointer) C.nvmlDevice_t {
	return C.nvmlDevice_t{handle: (*C.struct_nvmlDevice_st)(p)}
}

func instancePtr(i C.nvmlGpuInstance_t) unsafe.Pointer { return unsafe.Pointer(i.handle) }

func instanceHandle(p unsafe.Pointer) C.nvmlGpuInstance_t {
	return C.nvmlGpuInstance_t{handle: (*C.struct_nvmlGpuInstance_st)(p)}
}

func computePtr(c C.nvmlComputeInstance_t) unsafe.Pointer { return unsafe.Pointer(c.handle) }

func computeHandle(p unsafe.Pointer) C.nvmlComputeInstance_t {
	return C.nvmlComputeInstance_t{handle: (*C.struct_nvmlComputeInstance_st)(p)}
}

func setPtr(s C.nvmlEventSet_t) unsafe.Pointer { return unsafe.Pointer(s.handle) }

func setHandle(p unsafe.Pointer) C.nvmlEventSet_t {
	return C.nvmlEventSet_t{handle: (*C.struct_nvmlEventSet_st)(p)}
}
