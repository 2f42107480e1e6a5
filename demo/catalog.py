"""Applies the workload catalog (demo/NN-*.yaml) and reads back what each pod got: node,
devices, MIG profile or share, and what its container was given: GPU UUIDs, limits, device
nodes and driver files."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, dynamic

HERE = Path(__file__).resolve().parent
NAMESPACE = "flexgpu-demo"
UNSATISFIABLE = "too-big"
# What a share reserves (other capacities, such as multiprocessors, are consumed as 0).
SHARE_KEYS = ("compute", "memory")
LIMIT_KEYS = {
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "SMs%",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "mem",
}


# A whole GPU's device name; only other devices (MIG instances) are labelled by profile.
WHOLE_GPU = re.compile(r"gpu-\d+")


@dataclass
class Seen:
    """What a container was given: its environment, device nodes, driver files, device
    metadata files (KEP-5304) and other GPU mounts (MPS pipes and shared memory)."""

    env: dict[str, str] = field(default_factory=dict)
    device_nodes: list[str] = field(default_factory=list)
    driver_files: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    metadata: list[str] = field(default_factory=list)


@dataclass
class Row:
    pod: str
    node: str
    phase: str
    devices: str
    detail: str  # MIG profile, granted share or product
    limits: str  # what the container saw
    uuids: str = "-"  # GPU / MIG UUIDs from the container's FLEXGPU_DEVICE_* variables
    files: str = "-"  # device nodes and driver files in the container

    def cells(self) -> tuple[str, ...]:
        return (
            self.pod,
            self.node,
            self.phase,
            self.devices,
            self.detail,
            self.uuids,
            self.limits,
            self.files,
        )


def manifests() -> list[Path]:
    return sorted(HERE.glob("[0-9][0-9]-*.yaml"))


def reset_namespace(api: Any, namespace: str = NAMESPACE) -> None:
    """A fresh namespace (admin access allowed in it) for one run of the catalog."""
    core: Any = client.CoreV1Api(api)
    try:
        core.delete_namespace(namespace, grace_period_seconds=0)
    except client.ApiException as err:
        if err.status != 404:
            raise
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            core.create_namespace(
                {
                    "metadata": {
                        "name": namespace,
                        "labels": {"resource.kubernetes.io/admin-access": "true"},
                    }
                }
            )
            break
        except client.ApiException as err:
            if err.status != 409:  # still terminating
                raise
            # Pods on simulated nodes end only when their kubelet harness finishes them.
            time.sleep(0.5)
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_service_account("default", namespace)
            return
        except client.ApiException:
            time.sleep(0.2)
    raise RuntimeError(f"namespace {namespace} not ready")


def apply(api: Any, path: Path, namespace: str = NAMESPACE) -> list[str]:
    dyn = dynamic.DynamicClient(api)
    created = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        resource.create(body=doc, namespace=namespace if resource.namespaced else None)
        created.append(f"{doc['kind']}/{doc['metadata']['name']}")
    return created


def claim_names(pod: Any) -> list[str]:
    names = [r.resource_claim_name for r in pod.spec.resource_claims or [] if r.resource_claim_name]
    names += [
        r.resource_claim_name
        for r in pod.status.resource_claim_statuses or []
        if r.resource_claim_name
    ]
    return list(dict.fromkeys(names))


def env_of(log: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in log.splitlines() if "=" in line)


def granted(env: dict[str, str]) -> list[dict[str, str]]:
    """The devices a container got: one FLEXGPU_DEVICE_* variable per CDI device, its value
    ``uuid=...;claim=...;device=...[;timeSlice=...]``."""
    return [
        dict(part.split("=", 1) for part in value.split(";") if "=" in part)
        for key, value in sorted(env.items())
        if key.startswith("FLEXGPU_DEVICE_")
    ]


def _first(items: list[str], shown: int = 2) -> str:
    return ", ".join(items[:shown]) + (f" (+{len(items) - shown})" if len(items) > shown else "")


def short_uuid(uuid: str) -> str:
    """``GPU-6644dcb6`` for ``GPU-6644dcb6-8728-...``: enough to tell the demo's GPUs apart."""
    kind, _, rest = uuid.partition("-")
    return f"{kind}-{rest.split('-')[0]}" if rest else uuid


def files_cell(seen: Seen) -> str:
    metadata = f"; {len(seen.metadata)} metadata files" if seen.metadata else ""
    if not seen.device_nodes and not seen.driver_files and not seen.mounts:
        return "no device nodes or driver files" + metadata
    gpu_nodes = [p for p in seen.device_nodes if p.removeprefix("/dev/nvidia").isdigit()]
    other = len(seen.device_nodes) - len(gpu_nodes)
    parts = [_first(gpu_nodes)] if gpu_nodes else []
    if other:
        parts.append(f"{other} control/caps nodes")
    if seen.driver_files or seen.device_nodes:
        parts.append(f"{len(seen.driver_files)} driver files")
    if seen.mounts:
        parts.append(f"{len(seen.mounts)} mounts")
    return "; ".join(parts) + metadata


def rows(api: Any, seen_of: Callable[[str, str], Seen], namespace: str = NAMESPACE) -> list[Row]:
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    result = []
    for pod in sorted(core.list_namespaced_pod(namespace).items, key=lambda p: p.metadata.name):
        devices: list[str] = []
        details: list[str] = []
        for name in claim_names(pod):
            claim = resource.read_namespaced_resource_claim(name, namespace)
            allocation = claim.status.allocation if claim.status else None
            for r in allocation.devices.results if allocation else []:
                devices.append(r.device)
            for d in (claim.status.devices or []) if claim.status else []:
                data = d.data or {}
                if "migProfile" in data and not WHOLE_GPU.fullmatch(d.device):
                    details.append(data["migProfile"])
                elif "granted" in data:
                    details.append(
                        "share "
                        + ",".join(
                            f"{k}={v}"
                            for k, v in sorted(data["granted"].items())
                            if k in SHARE_KEYS
                        )
                    )
                elif "productName" in data:
                    details.append(data["productName"])
                if "timeSlice" in data:
                    details.append("time-sliced")
                elif "mps" in data and "granted" not in data:
                    details.append("MPS")
        shown = _first(devices)
        seen = seen_of(pod.spec.node_name or "", pod.metadata.name)
        env = seen.env
        got = granted(env)
        uuids = sorted({g["uuid"] for g in got if g.get("uuid")})
        gpus = len({g.get("uuid") for g in got})
        limits = [f"{gpus} GPU{'s' if gpus != 1 else ''} visible"] if gpus else []
        slices = sorted({g["timeSlice"] for g in got if "timeSlice" in g})
        limits += [f"time-slice {s}" for s in slices]
        limits += [f"{label} {env[key]}" for key, label in LIMIT_KEYS.items() if key in env]
        result.append(
            Row(
                pod.metadata.name,
                pod.spec.node_name or "-",
                str(pod.status.phase),
                shown or "-",
                ", ".join(dict.fromkeys(details)) or "-",
                "; ".join(limits) or "-",
                _first([short_uuid(u) for u in uuids]) or "-",
                files_cell(seen) if got else "-",
            )
        )
    return result


def wait_settled(
    api: Any,
    seen_of: Callable[[str, str], Seen],
    timeout_s: float = 180,
    namespace: str = NAMESPACE,
) -> list[Row]:
    """Until every pod but the unsatisfiable one runs and has printed what it sees."""
    deadline = time.monotonic() + timeout_s
    current = rows(api, seen_of, namespace)
    while time.monotonic() < deadline:
        ready = [r for r in current if r.pod != UNSATISFIABLE]
        # Claim status is written by the plugin just after prepare; wait for it too.
        if ready and all(
            r.phase == "Running" and "visible" in r.limits and r.detail != "-" for r in ready
        ):
            return current
        time.sleep(1)
        current = rows(api, seen_of, namespace)
    return current


def explanation(
    api: Any, pod: str = UNSATISFIABLE, timeout_s: float = 60, namespace: str = NAMESPACE
) -> str:
    core: Any = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={pod},involvedObject.kind=Pod"
        )
        for event in events.items:
            if event.reason == "GpuClaimUnsatisfiable":
                return str(event.message)
        time.sleep(1)
    return ""


def table(rows_: list[Row]) -> str:
    headers = (
        "POD",
        "NODE",
        "PHASE",
        "DEVICES",
        "MIG / SHARE / PRODUCT",
        "GPU UUIDS IN CONTAINER",
        "LIMITS IN CONTAINER",
        "DEVICE NODES / DRIVER FILES / MOUNTS",
    )
    data = [headers, *(r.cells() for r in rows_)]
    widths = [max(len(row[i]) for row in data) for i in range(len(headers))]
    return "\n".join(
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in data
    )
