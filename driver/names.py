"""Names users write into manifests. Changing any of them breaks installed clusters."""

from __future__ import annotations

from typing import Final

DRIVER_NAME: Final = "gpu.flexgpu.dev"
OPAQUE_API_VERSION: Final = "gpu.flexgpu.dev/v1alpha1"
CRD_GROUP: Final = "flexgpu.dev"

GPU_DEVICE_CLASS: Final = "gpu.flexgpu.dev"
MIG_DEVICE_CLASS: Final = "mig.flexgpu.dev"
SHARED_GPU_DEVICE_CLASS: Final = "shared-gpu.flexgpu.dev"

# Standard attributes shared across drivers (KEP-4381 / k8s.io/dynamic-resource-allocation).
PCI_BUS_ID_ATTRIBUTE: Final = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE: Final = "resource.kubernetes.io/pcieRoot"
NUMA_NODE_ATTRIBUTE: Final = "resource.kubernetes.io/numaNode"
# A shared GPU's namespace (tenant) while one holds it, "" while it is free; admission adds a
# selector on it to every shared-gpu request (docs/security-shared-gpus.md).
TENANT_ATTRIBUTE: Final = "tenant"

# Binding conditions (KEP-5007) of on-demand MIG partitions: the scheduler binds a pod once
# the plugin has created its partition and set PartitionReady, and sends it back to be
# scheduled again when PartitionFailed is set instead.
PARTITION_READY_CONDITION: Final = "gpu.flexgpu.dev/PartitionReady"
PARTITION_FAILED_CONDITION: Final = "gpu.flexgpu.dev/PartitionFailed"
# Binding conditions of a free shared GPU (Kubernetes 1.36+): the plugin gives the GPU to the
# namespace of the first claim it sees allocated there (TenantReady) and sends a claim of
# another namespace, allocated in the same instant, back to be scheduled (TenantTaken).
TENANT_READY_CONDITION: Final = "gpu.flexgpu.dev/TenantReady"
TENANT_TAKEN_CONDITION: Final = "gpu.flexgpu.dev/TenantTaken"
# NoSchedule taint on a GPU's partitions after creating one failed, for a cool-down.
PARTITION_FAILED_TAINT: Final = "gpu.flexgpu.dev/partition-create-failed"

CDI_VENDOR: Final = "gpu.flexgpu.dev"
CDI_CLASS: Final = "claim"
CDI_KIND: Final = f"{CDI_VENDOR}/{CDI_CLASS}"


def gpu_device_name(index: int) -> str:
    return f"gpu-{index}"


def mig_device_name(parent_index: int, profile: str, placement_start: int) -> str:
    """``gpu-0-mig-1g10gb-3``: profile names hold dots and '+', which DNS labels forbid."""
    label = profile.replace(".", "").replace("+", "-")
    return f"gpu-{parent_index}-mig-{label}-{placement_start}"
