"""Derives the --feature-gates value from what the built binaries accept, so a gate that is
GA-locked or removed in this version never breaks startup; and describes the gates of a
release for docs/admin.md (``python -m tools.cluster.gate_report``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# The DRA features flexgpu uses beyond what is GA: partitionable devices (dynamic MIG),
# consumable capacity (GPU fractions), device taints (repartitioning without a drain),
# binding conditions, device health in pod status, prioritized lists and admin access.
WANTED = (
    "DRAPartitionableDevices",
    "DRAConsumableCapacity",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRADeviceBindingConditions",
    "DRAResourceClaimDeviceStatus",
    "ResourceHealthStatus",
    "DRAPrioritizedList",
    "DRAAdminAccess",
)
# Gang scheduling (KEP-4671) and claims for PodGroups (KEP-5729): off by default through
# 1.37, so only a control plane started with ``workloads=True`` turns them on. 1.36 keeps the
# scheduler's gang plugin behind a gate of its own (GangScheduling), which 1.37 folded into
# GenericWorkload; a gate a release does not list is left out as with WANTED.
WORKLOAD_GATES = ("GenericWorkload", "GangScheduling", "DRAWorkloadResourceClaims")
# Without these two no PodGroup claim is honoured: a control plane asked for workloads that
# does not list them is refused rather than started without them.
WORKLOAD_REQUIRED = ("GenericWorkload", "DRAWorkloadResourceClaims")
# Reported beside WANTED (never enabled by default): extended resources backed by DRA, which
# the chart's deviceClasses.gpuExtendedResourceName relies on, and the workload gates.
REPORTED = (*WANTED, "DRAExtendedResource", "GenericWorkload", "DRAWorkloadResourceClaims")

_GATE_LINE = re.compile(
    r"(?:kube:)?([A-Za-z0-9]+)=true\|false \((ALPHA|BETA|GA|DEPRECATED)(?: - default=(\w+))?"
)


# API versions that are off by default but that the scheduler and the controller manager
# watch once the gate is on; without them their informers never sync and no pod is
# scheduled. Read from each release's sources: DeviceTaintRules: 1.34 and 1.35 watch
# v1alpha3, 1.36 v1beta2, 1.37 the GA v1. Workloads and PodGroups: 1.36 (read in
# v1.36.0-rc.0) v1alpha2, 1.37 v1beta1 (pkg/scheduler/eventhandlers.go, the resourceclaim
# controller's PodGroup reads).
_GATED_APIS = {
    ("DRADeviceTaints", 34): "resource.k8s.io/v1alpha3",
    ("DRADeviceTaintRules", 35): "resource.k8s.io/v1alpha3",
    ("DRADeviceTaintRules", 36): "resource.k8s.io/v1beta2",
    ("GenericWorkload", 36): "scheduling.k8s.io/v1alpha2",
    ("GenericWorkload", 37): "scheduling.k8s.io/v1beta1",
}


def runtime_config_arg(gates: str, minor: int) -> str:
    """The apiserver's --runtime-config value (may be empty) for the given --feature-gates
    value on release 1.<minor>."""
    enabled = {g.partition("=")[0] for g in gates.split(",") if g.endswith("=true")}
    apis = sorted({api for (gate, m), api in _GATED_APIS.items() if m == minor and gate in enabled})
    return ",".join(f"{api}=true" for api in apis)


def settable_gates(binary: Path) -> dict[str, str]:
    """Gate name -> stage, for every gate the binary's --help lists as settable."""
    return {name: stage for name, (stage, _) in gate_defaults(binary).items()}


def gate_defaults(binary: Path) -> dict[str, tuple[str, str]]:
    """Gate name -> (stage, default) for every gate the binary's --help lists as settable."""
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return {
        m.group(1): (m.group(2), m.group(3) or "?")
        for m in _GATE_LINE.finditer(out.stdout + out.stderr)
    }


def describe(folder: Path, names: tuple[str, ...] = REPORTED) -> list[str]:
    """One line per gate: its stage and default in the apiserver, or that it is not settable
    (GA and locked on, or not in this release at all: the gate's own history says which)."""
    gates = gate_defaults(folder / "kube-apiserver")
    lines = []
    for name in names:
        stage, default = gates.get(name, ("not settable", "-"))
        lines.append(f"{name}: {stage} (default {default})")
    return lines


def feature_gates_arg(binaries: list[Path], wanted: tuple[str, ...] = WANTED) -> str:
    """Enables each wanted gate that every given binary lists (the same value for all)."""
    common: set[str] | None = None
    for binary in binaries:
        names = set(settable_gates(binary))
        common = names if common is None else common & names
    chosen = [g for g in wanted if g in (common or set())]
    return ",".join(f"{g}=true" for g in chosen)
