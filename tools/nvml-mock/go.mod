// An NVML C library (libnvidia-ml.so.1) over NVIDIA's mock NVML servers, so the NVML backend
// and the kubelet plugin run through the unmodified pynvml module in tests. Tooling only.
module flexgpu.dev/tools/nvml-mock

go 1.24

require (
	github.com/NVIDIA/go-nvml v0.13.4-1
	github.com/google/uuid v1.6.0
)
