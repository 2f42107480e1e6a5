package main

// NVML events over the shared event log, and the controls tests use to change the hardware:
// inject an Xid, lose a GPU, run processes with a load. The controls are extra C functions
// (flexgpuMock*), reachable from any process that loads the library, and name GPUs by their
// position in the machine description, which does not change with device visibility.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#cgo CFLAGS: -I${SRCDIR}
#include "nvml_exports.h"
*/
import "C"

import (
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Event types this library can raise; the rest of NVML's are accepted and never fire.
const supportedEvents = C.nvmlEventTypeSingleBitEccError | C.nvmlEventTypeDoubleBitEccError |
	C.nvmlEventTypePState | C.nvmlEventTypeXidCriticalError | C.nvmlEventTypeClock

//export nvmlEventSetCreate
func nvmlEventSetCreate(out *C.nvmlEventSet_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if out == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		set := &eventSet{registered: map[string]uint64{}, seen: ss.s.NextSeq}
		if set.seen > 0 {
			set.seen-- // NextSeq is the next event's number; everything before it is past
		}
		*out = setHandle(pointerFor(handle{kind: kindEventSet, set: set}))
		return nvml.SUCCESS
	})
}

//export nvmlEventSetFree
func nvmlEventSetFree(set C.nvmlEventSet_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if _, ok := handleAt(setPtr(set), kindEventSet); !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetSupportedEventTypes
func nvmlDeviceGetSupportedEventTypes(device C.nvmlDevice_t, types *C.ulonglong) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		if _, r := ss.device(devicePtr(device)); r != nvml.SUCCESS {
			return r
		}
		*types = supportedEvents
		return nvml.SUCCESS
	})
}

//export nvmlDeviceRegisterEvents
func nvmlDeviceRegisterEvents(device C.nvmlDevice_t, types C.ulonglong, set C.nvmlEventSet_t) C.nvmlReturn_t {
	return call(func(ss *session) nvml.Return {
		g, r := ss.device(devicePtr(device))
		if r != nvml.SUCCESS {
			return r
		}
		h, ok := handleAt(setPtr(set), kindEventSet)
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if uint64(types)&^uint64(supportedEvents) != 0 {
			return nvml.ERROR_NOT_SUPPORTED
		}
		h.set.registered[g.uuid] |= uint64(types)
		return nvml.SUCCESS
	})
}

// nvmlEventSetWait_v2 polls the shared log, since the events may come from another process.
// Events waiting for the set are delivered first; once none is left, a GPU registered in the
// set that has fallen off the bus makes the wait answer GPU_IS_LOST at once, on every call
// while it stays lost, with data left unset (NVML does not say which GPU): callers find the
// lost GPU by asking each one, and stop waiting on it by building a set without it.
//
//export nvmlEventSetWait_v2
func nvmlEventSetWait_v2(set C.nvmlEventSet_t, data *C.nvmlEventData_t, timeoutMs C.uint) C.nvmlReturn_t {
	deadline := time.Now().Add(time.Duration(timeoutMs) * time.Millisecond)
	for {
		found := false
		r := call(func(ss *session) nvml.Return {
			h, ok := handleAt(setPtr(set), kindEventSet)
			if !ok || data == nil {
				return nvml.ERROR_INVALID_ARGUMENT
			}
			for _, e := range ss.s.Events {
				if e.Seq <= h.set.seen {
					continue
				}
				h.set.seen = e.Seq
				if h.set.registered[e.UUID]&e.Type == 0 || ss.byUUID(e.UUID) == nil {
					continue
				}
				*data = C.nvmlEventData_t{
					device:            deviceHandle(pointerFor(handle{kind: kindDevice, uuid: e.UUID})),
					eventType:         C.ulonglong(e.Type),
					eventData:         C.ulonglong(e.Data),
					gpuInstanceId:     C.uint(e.GpuInstanceID),
					computeInstanceId: C.uint(e.ComputeInstanceID),
				}
				found = true
				return nvml.SUCCESS
			}
			if ss.lostIn(h.set) {
				return nvml.ERROR_GPU_IS_LOST
			}
			return nvml.SUCCESS
		})
		if r != C.NVML_SUCCESS || found {
			return r
		}
		if !time.Now().Before(deadline) {
			return C.NVML_ERROR_TIMEOUT
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lostIn reports whether a GPU this process sees, registered in set, is lost.
func (ss *session) lostIn(set *eventSet) bool {
	for _, g := range ss.visible() {
		if _, ok := set.registered[g.uuid]; ok && ss.st(g).Lost {
			return true
		}
	}
	return false
}

// -- test controls -------------------------------------------------------------------------

var controlLock sync.Mutex

// control changes the state of the machine described at config, kept in the state file at
// statePath (empty: beside config). It needs no nvmlInit, so a test process can drive the
// hardware of a plugin running elsewhere.
func control(config, statePath *C.char, index C.uint, fn func(*session, *gpu)) C.nvmlReturn_t {
	controlLock.Lock()
	defer controlLock.Unlock()
	if config == nil {
		return ret(nvml.ERROR_INVALID_ARGUMENT)
	}
	m, err := loadMachine(C.GoString(config))
	if err != nil {
		fmt.Fprintf(os.Stderr, "libnvidia-ml (flexgpu mock): %v\n", err)
		return ret(nvml.ERROR_INVALID_ARGUMENT)
	}
	path := m.path + ".state"
	if statePath != nil && C.GoString(statePath) != "" {
		path = C.GoString(statePath)
	}
	if int(index) >= len(m.gpus) {
		return ret(nvml.ERROR_INVALID_ARGUMENT)
	}
	err = withState(path, func(s *state) (bool, error) {
		fn(&session{m: m, s: s}, m.gpus[index])
		return true, nil
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "libnvidia-ml (flexgpu mock): state %s: %v\n", path, err)
		return ret(nvml.ERROR_UNKNOWN)
	}
	return ret(nvml.SUCCESS)
}

// flexgpuMockInjectXid raises an Xid critical error event on GPU index (machine order), in
// GPU instance gi and compute instance ci (0xFFFFFFFF: none).
//
//export flexgpuMockInjectXid
func flexgpuMockInjectXid(config, statePath *C.char, index C.uint, xid C.ulonglong, gi C.uint, ci C.uint) C.nvmlReturn_t {
	return control(config, statePath, index, func(ss *session, g *gpu) {
		ss.s.addEvent(event{
			UUID: g.uuid, Type: uint64(C.nvmlEventTypeXidCriticalError), Data: uint64(xid),
			GpuInstanceID: uint32(gi), ComputeInstanceID: uint32(ci),
		})
	})
}

// flexgpuMockSetLost makes GPU index answer GPU_IS_LOST (lost != 0) or work again.
//
//export flexgpuMockSetLost
func flexgpuMockSetLost(config, statePath *C.char, index C.uint, lost C.int) C.nvmlReturn_t {
	return control(config, statePath, index, func(ss *session, g *gpu) {
		ss.st(g).Lost = lost != 0
	})
}

// flexgpuMockSetProcesses replaces the processes running on GPU index with a JSON array of
// {"pid", "usedMiB", "gpuInstanceId"?, "computeInstanceId"?, "smUtil"?, "memUtil"?}; a process
// with smUtil set is a utilisation sample taken now.
//
//export flexgpuMockSetProcesses
func flexgpuMockSetProcesses(config, statePath *C.char, index C.uint, processesJSON *C.char) C.nvmlReturn_t {
	var procs []process
	if processesJSON == nil || json.Unmarshal([]byte(C.GoString(processesJSON)), &procs) != nil {
		return ret(nvml.ERROR_INVALID_ARGUMENT)
	}
	now := uint64(time.Now().UnixMicro())
	for i := range procs {
		if procs[i].SmUtil != nil {
			procs[i].TimeStampUs = now
		}
	}
	return control(config, statePath, index, func(ss *session, g *gpu) {
		ss.st(g).Processes = procs
	})
}
