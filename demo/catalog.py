"""Applies the workload catalog (demo/NN-*.yaml) and reads back what each pod got: node,
devices, MIG profile or share, and the limits its container saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class Row:
    pod: str
    node: str
    phase: str
    devices: str
    detail: str  # MIG profile, granted share or product
    limits: str  # what the container saw

    def cells(self) -> tuple[str, ...]:
        return (self.pod, self.node, self.phase, self.devices, self.detail, self.limits)


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


def rows(api: Any, log_of: Callable[[str, str], str], namespace: str = NAMESPACE) -> list[Row]:
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
                if "migProfile" in data:
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
        shown = ", ".join(devices[:2]) + (f" (+{len(devices) - 2})" if len(devices) > 2 else "")
        env = env_of(log_of(pod.spec.node_name or "", pod.metadata.name))
        got = granted(env)
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
            )
        )
    return result


def wait_settled(
    api: Any, log_of: Callable[[str, str], str], timeout_s: float = 180, namespace: str = NAMESPACE
) -> list[Row]:
    """Until every pod but the unsatisfiable one runs and has printed what it sees."""
    deadline = time.monotonic() + timeout_s
    current = rows(api, log_of, namespace)
    while time.monotonic() < deadline:
        ready = [r for r in current if r.pod != UNSATISFIABLE]
        # Claim status is written by the plugin just after prepare; wait for it too.
        if ready and all(
            r.phase == "Running" and "visible" in r.limits and r.detail != "-" for r in ready
        ):
            return current
        time.sleep(1)
        current = rows(api, log_of, namespace)
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
    headers = ("POD", "NODE", "PHASE", "DEVICES", "MIG / SHARE / PRODUCT", "SEEN IN CONTAINER")
    data = [headers, *(r.cells() for r in rows_)]
    widths = [max(len(row[i]) for row in data) for i in range(len(headers))]
    return "\n".join(
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in data
    )
