"""NVIDIA's own DRA kubelet plugin (sigs.k8s.io/dra-driver-nvidia-gpu, built by
tools/nvidia-driver/build.sh) and flexgpu's, each run as a simulated node of the test world over
the same NVML mock machine, for the differential tests (tooling, not product)."""

from tools.nvidia_twin.plugins import (
    CHART_GATES,
    DYNAMIC_MIG_GATES,
    NVIDIA_DRIVER,
    STATIC_GATES,
    TwinPlugin,
    flexgpu_twin,
    nvidia_plugin_binary,
    nvidia_twin,
)

__all__ = [
    "CHART_GATES",
    "DYNAMIC_MIG_GATES",
    "NVIDIA_DRIVER",
    "STATIC_GATES",
    "TwinPlugin",
    "flexgpu_twin",
    "nvidia_plugin_binary",
    "nvidia_twin",
]
