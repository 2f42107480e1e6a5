/* NVML's header as the exporting files of this library read it. cgo writes each exported
 * function's prototype without const qualifiers, so the functions whose header prototypes carry
 * them are renamed out of the way while the header is read; the exports keep NVML's names and
 * ABI (a const qualifier does not change how a pointer is passed). */
#define nvmlDeviceCreateGpuInstanceWithPlacement flexgpu_header_nvmlDeviceCreateGpuInstanceWithPlacement
#define nvmlErrorString flexgpu_header_nvmlErrorString
#define nvmlDeviceGetHandleByUUID flexgpu_header_nvmlDeviceGetHandleByUUID
#define nvmlDeviceGetHandleByPciBusId_v2 flexgpu_header_nvmlDeviceGetHandleByPciBusId_v2
#include <nvml.h>
#undef nvmlDeviceCreateGpuInstanceWithPlacement
#undef nvmlErrorString
#undef nvmlDeviceGetHandleByUUID
#undef nvmlDeviceGetHandleByPciBusId_v2
