package main

// The machine this library pretends to be: GPUs built by NVIDIA's mock NVML servers from a
// JSON description, plus what those servers do not model (NVLink wiring, fixed identities).

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/gpus"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/google/uuid"
)

// model is one GPU product: NVIDIA's mock configuration and the marketed memory size that
// NVML's MIG profile names are built from (the mock tables carry no names).
type model struct {
	config     gpus.Config
	marketedGB int
}

// teslaT4 has no MIG, which none of the mock's GPUs lacks; the contract suite needs one such GPU.
// Figures from NVIDIA's T4 specification and what NVML reports for it.
var teslaT4 = gpus.Config{
	Name:         "Tesla T4",
	Architecture: nvml.DEVICE_ARCH_TURING,
	Brand:        nvml.BRAND_TESLA,
	MemoryMB:     15360,
	CudaMajor:    7,
	CudaMinor:    5,
	PciDeviceId:  0x1EB810DE,
}

var models = map[string]model{
	"A100-SXM4-40GB":  {gpus.A100_SXM4_40GB, 40},
	"A100-SXM4-80GB":  {gpus.A100_SXM4_80GB, 80},
	"H100-SXM5-80GB":  {gpus.H100_SXM5_80GB, 80},
	"H200-SXM5-141GB": {gpus.H200_SXM5_141GB, 141},
	"B200-SXM6-180GB": {gpus.B200_SXM5_180GB, 180}, // the mock says SXM5; B200 boards are SXM6
	"T4":              {teslaT4, 0},
}

// dgxMachines are NVIDIA's eight-GPU mock servers, used whole.
var dgxMachines = map[string]struct {
	build func() *server.Server
	model string
}{
	"dgxa100": {dgxa100.New, "A100-SXM4-40GB"},
	"dgxh100": {dgxh100.New, "H100-SXM5-80GB"},
	"dgxh200": {dgxh200.New, "H200-SXM5-141GB"},
	"dgxb200": {dgxb200.New, "B200-SXM6-180GB"},
}

// profileIdentity is what NVML reports for each GPU-instance profile enum on the GPUs with
// eight memory slices (A100, H100, H200, B200): the profile id and the memory slices its name
// counts. The mock keys its tables by the enum and sets the id to the enum value.
var profileIdentity = map[int]struct {
	id, memorySlices int
	suffix           string
}{
	nvml.GPU_INSTANCE_PROFILE_1_SLICE:      {19, 1, ""},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1: {20, 1, "+me"},
	nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2: {15, 2, ""},
	nvml.GPU_INSTANCE_PROFILE_2_SLICE:      {14, 2, ""},
	nvml.GPU_INSTANCE_PROFILE_3_SLICE:      {9, 4, ""},
	nvml.GPU_INSTANCE_PROFILE_4_SLICE:      {5, 4, ""},
	nvml.GPU_INSTANCE_PROFILE_7_SLICE:      {0, 8, ""},
}

type gpuSpec struct {
	Model      string `json:"model"`
	UUID       string `json:"uuid"`
	PciBusID   string `json:"pciBusId"`
	Minor      *int   `json:"minor"`
	MigEnabled bool   `json:"migEnabled"`
}

type linkGroup struct {
	Gpus  []int `json:"gpus"`
	Links int   `json:"links"`
}

type machineSpec struct {
	Machine           string      `json:"machine"`
	Gpus              []gpuSpec   `json:"gpus"`
	DriverVersion     string      `json:"driverVersion"`
	CudaDriverVersion int         `json:"cudaDriverVersion"`
	NvLinks           []linkGroup `json:"nvlinks"`
	NvSwitch          *linkGroup  `json:"nvswitch"`
	// AddressingMode is the platform's: how system memory is addressable from the GPUs (HMM,
	// ATS, None). Unset: NVML answers NOT_SUPPORTED, as on a platform that reports none.
	AddressingMode string `json:"addressingMode"`
}

// link is one NVLink of a GPU: to another GPU (peer >= 0) or to an NVSwitch (peer < 0).
type link struct{ peer int }

type gpu struct {
	device     *server.Device
	model      model
	uuid       string
	domain     uint32
	bus        uint32
	slot       uint32
	minor      int
	migDefault bool
	links      []link
}

func (g *gpu) migCapable() bool { return len(g.model.config.MIGProfiles.GpuInstanceProfiles) > 0 }

func (g *gpu) busID() string { return fmt.Sprintf("%08X:%02X:%02X.0", g.domain, g.bus, g.slot) }

func (g *gpu) busIDLegacy() string { return fmt.Sprintf("%04X:%02X:%02X.0", g.domain, g.bus, g.slot) }

type machine struct {
	path           string
	srv            *server.Server
	gpus           []*gpu
	driverVersion  string
	cudaVersion    int
	addressingMode *uint32 // nil: not supported on this platform
}

// addressingModes are the values nvmlDeviceGetAddressingMode reports, by the names nvidia-smi
// prints for them.
var addressingModes = map[string]uint32{
	"None": uint32(nvml.DEVICE_ADDRESSING_MODE_NONE),
	"HMM":  uint32(nvml.DEVICE_ADDRESSING_MODE_HMM),
	"ATS":  uint32(nvml.DEVICE_ADDRESSING_MODE_ATS),
}

func parseBusID(text string) (uint32, uint32, uint32, error) {
	// "0000:07:00.0" or "00000000:07:00.0"
	parts := strings.Split(text, ":")
	if len(parts) != 3 || !strings.Contains(parts[2], ".") {
		return 0, 0, 0, fmt.Errorf("pciBusId %q: want DOMAIN:BUS:DEVICE.FUNCTION", text)
	}
	domain, err1 := strconv.ParseUint(parts[0], 16, 32)
	bus, err2 := strconv.ParseUint(parts[1], 16, 8)
	slot, err3 := strconv.ParseUint(strings.Split(parts[2], ".")[0], 16, 8)
	if err1 != nil || err2 != nil || err3 != nil {
		return 0, 0, 0, fmt.Errorf("pciBusId %q: fields must be hexadecimal", text)
	}
	return uint32(domain), uint32(bus), uint32(slot), nil
}

func loadMachine(path string) (*machine, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var spec machineSpec
	decoder := json.NewDecoder(strings.NewReader(string(raw)))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&spec); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	absolute, _ := filepath.Abs(path)
	if spec.DriverVersion == "" {
		spec.DriverVersion = "550.54.15" // what NVIDIA's DGX mock servers report
	}
	if spec.CudaDriverVersion == 0 {
		spec.CudaDriverVersion = 12040
	}

	var srv *server.Server
	var gpuModels []string
	if spec.Machine != "" {
		dgx, ok := dgxMachines[spec.Machine]
		if !ok {
			return nil, fmt.Errorf("machine %q: allowed values are dgxa100, dgxh100, dgxh200, dgxb200", spec.Machine)
		}
		srv = dgx.build()
		for range srv.Devices {
			gpuModels = append(gpuModels, dgx.model)
		}
		if len(spec.Gpus) > len(gpuModels) {
			return nil, fmt.Errorf("machine %s has %d GPUs; gpus lists %d", spec.Machine, len(gpuModels), len(spec.Gpus))
		}
	} else {
		var configs []gpus.Config
		for i, g := range spec.Gpus {
			m, ok := models[g.Model]
			if !ok {
				allowed := make([]string, 0, len(models))
				for key := range models {
					allowed = append(allowed, key)
				}
				sort.Strings(allowed)
				return nil, fmt.Errorf("gpus[%d].model %q: allowed values are %s", i, g.Model, strings.Join(allowed, ", "))
			}
			configs = append(configs, m.config)
			gpuModels = append(gpuModels, g.Model)
		}
		srv, _ = server.New(server.WithGPUs(configs...))
	}
	srv.DriverVersion = spec.DriverVersion
	srv.CudaDriverVersion = spec.CudaDriverVersion

	m := &machine{path: absolute, srv: srv, driverVersion: spec.DriverVersion, cudaVersion: spec.CudaDriverVersion}
	if spec.AddressingMode != "" {
		mode, ok := addressingModes[spec.AddressingMode]
		if !ok {
			return nil, fmt.Errorf("addressingMode %q: allowed values are None, HMM, ATS (or leave it unset: not supported)", spec.AddressingMode)
		}
		m.addressingMode = &mode
	}
	for i, device := range srv.Devices {
		d := device.(*server.Device)
		g := &gpu{device: d, model: models[gpuModels[i]], minor: i, bus: uint32(i + 1)}
		// Identities must survive process restarts; the mock draws a random UUID each time.
		g.uuid = "GPU-" + uuid.NewSHA1(uuid.NameSpaceOID, []byte(fmt.Sprintf("%s#%d", absolute, i))).String()
		if i < len(spec.Gpus) {
			s := spec.Gpus[i]
			if s.UUID != "" {
				g.uuid = s.UUID
			}
			if s.PciBusID != "" {
				var err error
				if g.domain, g.bus, g.slot, err = parseBusID(s.PciBusID); err != nil {
					return nil, fmt.Errorf("gpus[%d]: %w", i, err)
				}
			}
			if s.Minor != nil {
				g.minor = *s.Minor
			}
			g.migDefault = s.MigEnabled
		}
		d.UUID = g.uuid
		d.PciBusID = g.busIDLegacy()
		d.Minor = g.minor
		m.gpus = append(m.gpus, g)
	}
	wire := func(group linkGroup, what string, pair bool) error {
		for _, index := range group.Gpus {
			if index < 0 || index >= len(m.gpus) {
				return fmt.Errorf("%s.gpus: index %d out of range 0..%d", what, index, len(m.gpus)-1)
			}
		}
		if pair && len(group.Gpus) != 2 {
			return fmt.Errorf("%s.gpus: want two GPU indices, got %v", what, group.Gpus)
		}
		if group.Links <= 0 {
			return fmt.Errorf("%s.links: want a positive link count, got %d", what, group.Links)
		}
		for n, index := range group.Gpus {
			peer := -1
			if pair {
				peer = group.Gpus[1-n]
			}
			for l := 0; l < group.Links; l++ {
				m.gpus[index].links = append(m.gpus[index].links, link{peer: peer})
			}
		}
		return nil
	}
	for i, group := range spec.NvLinks {
		if err := wire(group, fmt.Sprintf("nvlinks[%d]", i), true); err != nil {
			return nil, err
		}
	}
	if spec.NvSwitch != nil {
		if err := wire(*spec.NvSwitch, "nvswitch", false); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// profileByIndex is the mock's GPU-instance profile for an NVML enum, with the id and name that
// NVML reports for it.
func (g *gpu) profileByIndex(index int) (nvml.GpuInstanceProfileInfo, string, nvml.Return) {
	info, ret := g.device.GetGpuInstanceProfileInfo(index)
	if ret != nvml.SUCCESS {
		return info, "", ret
	}
	identity, ok := profileIdentity[index]
	if !ok {
		return info, "", nvml.ERROR_NOT_SUPPORTED
	}
	info.Id = uint32(identity.id)
	// NVML names count memory in marketed gigabytes per memory slice, rounded half up.
	gb := (2*g.model.marketedGB*identity.memorySlices + 8) / 16
	name := fmt.Sprintf("MIG %dg.%dgb%s", info.SliceCount, gb, identity.suffix)
	return info, name, nvml.SUCCESS
}

// profileByID finds the enum of an NVML profile id on this GPU.
func (g *gpu) profileByID(id int) (int, nvml.GpuInstanceProfileInfo, string, bool) {
	for index := range g.model.config.MIGProfiles.GpuInstanceProfiles {
		info, name, ret := g.profileByIndex(index)
		if ret == nvml.SUCCESS && int(info.Id) == id {
			return index, info, name, true
		}
	}
	return 0, nvml.GpuInstanceProfileInfo{}, "", false
}

func (g *gpu) placements(index int) []nvml.GpuInstancePlacement {
	info := nvml.GpuInstanceProfileInfo{Id: uint32(index)}
	placements, _ := g.device.GetGpuInstancePossiblePlacements(&info)
	return placements
}

// computeProfile is the mock's compute-instance profile ciIndex inside a GPU instance of
// GPU-instance profile giIndex.
func (g *gpu) computeProfile(giIndex, ciIndex, engine int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	gi := server.NewGpuInstanceFromInfo(nvml.GpuInstanceInfo{ProfileId: uint32(giIndex)}, g.model.config.MIGProfiles)
	return gi.GetComputeInstanceProfileInfo(ciIndex, engine)
}

func (g *gpu) maxMigDevices() int {
	info, ret := g.device.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if ret != nvml.SUCCESS {
		return 0
	}
	return int(info.InstanceCount)
}
