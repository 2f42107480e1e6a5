package main

// Library lifetime, environment, opaque handles and the per-call session over machine and state.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1 -Wno-deprecated-declarations
#include <stdlib.h>
#include <nvml.h>
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Environment: the machine description, the state file (default: beside it), and a device
// folder whose nvidiaN nodes decide which GPUs this process sees (unset: all of them).
const (
	envConfig = "FLEXGPU_NVML_MOCK_CONFIG"
	envState  = "FLEXGPU_NVML_MOCK_STATE"
	envDevDir = "FLEXGPU_NVML_MOCK_DEV_DIR"
)

// getenv reads the C environment at call time: Go's copy is taken when the library loads, and
// a test process sets these variables after that.
func getenv(name string) string {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	value := C.getenv(cname)
	if value == nil {
		return ""
	}
	return C.GoString(value)
}

type handleKind int

const (
	kindDevice handleKind = iota
	kindMigDevice
	kindGpuInstance
	kindComputeInstance
	kindEventSet
)

type handle struct {
	kind handleKind
	uuid string // parent GPU
	gi   int
	ci   int
	set  *eventSet
}

func (h handle) key() string {
	return fmt.Sprintf("%d/%s/%d/%d/%p", h.kind, h.uuid, h.gi, h.ci, h.set)
}

// eventSet is per process, as in NVML: which GPUs report which event types, and how far this
// set has read the shared event log.
type eventSet struct {
	registered map[string]uint64
	seen       uint64
}

var lib struct {
	sync.Mutex
	refs      int
	machine   *machine
	statePath string
	devDir    string
	handles   map[uintptr]*handle
	pointers  map[string]unsafe.Pointer
}

// pointerFor returns the same C pointer for the same object every time, as NVML's handles are
// stable; the memory is C memory so C callers may keep it.
func pointerFor(h handle) unsafe.Pointer {
	if lib.handles == nil {
		lib.handles = map[uintptr]*handle{}
		lib.pointers = map[string]unsafe.Pointer{}
	}
	key := h.key()
	if p, ok := lib.pointers[key]; ok {
		return p
	}
	p := C.malloc(16)
	copied := h
	lib.handles[uintptr(p)] = &copied
	lib.pointers[key] = p
	return p
}

func handleAt(p unsafe.Pointer, kind handleKind) (*handle, bool) {
	h, ok := lib.handles[uintptr(p)]
	if !ok || h.kind != kind {
		return nil, false
	}
	return h, true
}

func initialise() nvml.Return {
	lib.Lock()
	defer lib.Unlock()
	if lib.refs > 0 {
		lib.refs++
		return nvml.SUCCESS
	}
	config := getenv(envConfig)
	if config == "" {
		return nvml.ERROR_DRIVER_NOT_LOADED
	}
	m, err := loadMachine(config)
	if err != nil {
		fmt.Fprintf(os.Stderr, "libnvidia-ml (flexgpu mock): %v\n", err)
		return nvml.ERROR_DRIVER_NOT_LOADED
	}
	lib.machine = m
	lib.statePath = getenv(envState)
	if lib.statePath == "" {
		lib.statePath = m.path + ".state"
	}
	lib.statePath, _ = filepath.Abs(lib.statePath)
	lib.devDir = getenv(envDevDir)
	lib.refs = 1
	return nvml.SUCCESS
}

func shutdown() nvml.Return {
	lib.Lock()
	defer lib.Unlock()
	if lib.refs == 0 {
		return nvml.ERROR_UNINITIALIZED
	}
	lib.refs--
	return nvml.SUCCESS
}

// session is one NVML call: the machine, the shared state read under its lock, and whether the
// call changed that state.
type session struct {
	m       *machine
	s       *state
	changed bool
}

// call runs fn for one NVML entry point. It holds the library lock (handles, event sets) and
// the state file lock for the whole call.
func call(fn func(*session) nvml.Return) C.nvmlReturn_t {
	lib.Lock()
	defer lib.Unlock()
	if lib.refs == 0 {
		return C.nvmlReturn_t(nvml.ERROR_UNINITIALIZED)
	}
	ret := nvml.SUCCESS
	err := withState(lib.statePath, func(s *state) (bool, error) {
		ss := &session{m: lib.machine, s: s}
		ret = fn(ss)
		return ss.changed, nil
	})
	if err != nil {
		fmt.Fprintf(os.Stderr, "libnvidia-ml (flexgpu mock): state %s: %v\n", lib.statePath, err)
		return C.nvmlReturn_t(nvml.ERROR_UNKNOWN)
	}
	return C.nvmlReturn_t(ret)
}

// visible lists the GPUs this process may see, in NVML index order: like the driver in a
// container, only those whose device node exists when a device folder is set.
func (ss *session) visible() []*gpu {
	if lib.devDir == "" {
		return ss.m.gpus
	}
	var seen []*gpu
	for _, g := range ss.m.gpus {
		if _, err := os.Stat(filepath.Join(lib.devDir, fmt.Sprintf("nvidia%d", g.minor))); err == nil {
			seen = append(seen, g)
		}
	}
	return seen
}

func (ss *session) byUUID(uuid string) *gpu {
	for _, g := range ss.visible() {
		if g.uuid == uuid {
			return g
		}
	}
	return nil
}

func (ss *session) st(g *gpu) *gpuState { return ss.s.gpu(ss.m, g) }

// device resolves a GPU handle (kindDevice); a lost GPU answers GPU_IS_LOST to everything.
func (ss *session) device(p unsafe.Pointer) (*gpu, nvml.Return) {
	h, ok := handleAt(p, kindDevice)
	if !ok {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := ss.byUUID(h.uuid)
	if g == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if ss.st(g).Lost {
		return nil, nvml.ERROR_GPU_IS_LOST
	}
	return g, nvml.SUCCESS
}

func (ss *session) gpuInstance(g *gpu, id int) *gpuInstance {
	st := ss.st(g)
	for i := range st.GpuInstances {
		if st.GpuInstances[i].ID == id {
			return &st.GpuInstances[i]
		}
	}
	return nil
}

// instanceOf resolves a GPU-instance handle to its GPU and instance.
func (ss *session) instanceOf(p unsafe.Pointer) (*gpu, *gpuInstance, nvml.Return) {
	h, ok := handleAt(p, kindGpuInstance)
	if !ok {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := ss.byUUID(h.uuid)
	if g == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if ss.st(g).Lost {
		return nil, nil, nvml.ERROR_GPU_IS_LOST
	}
	gi := ss.gpuInstance(g, h.gi)
	if gi == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, gi, nvml.SUCCESS
}

// migDevices lists every compute instance of a GPU, in the order NVML indexes MIG devices.
func (ss *session) migDevices(g *gpu) []handle {
	var out []handle
	for _, gi := range ss.st(g).GpuInstances {
		for _, ci := range gi.ComputeInstances {
			out = append(out, handle{kind: kindMigDevice, uuid: g.uuid, gi: gi.ID, ci: ci.ID})
		}
	}
	return out
}

func (ss *session) computeInstance(g *gpu, giID, ciID int) (*gpuInstance, *computeInstance) {
	gi := ss.gpuInstance(g, giID)
	if gi == nil {
		return nil, nil
	}
	for i := range gi.ComputeInstances {
		if gi.ComputeInstances[i].ID == ciID {
			return gi, &gi.ComputeInstances[i]
		}
	}
	return gi, nil
}

func (ss *session) busy(g *gpu, giID int, ciID int) bool {
	for _, p := range ss.st(g).Processes {
		if p.GpuInstanceID != nil && *p.GpuInstanceID == giID &&
			(ciID < 0 || p.ComputeInstanceID == nil || *p.ComputeInstanceID == ciID) {
			return true
		}
	}
	return false
}
