"""API-shaped objects for the controller's unit tests, loaded into a ``ClusterState``."""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

from flexgpu.controller.cluster_state import ClusterState, Kind, Snapshot
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import render_node_gpus, slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
A = f'device.attributes["{DRIVER_NAME}"]'
CAP = f'device.capacity["{DRIVER_NAME}"]'
CLASSES = {
    "gpu.flexgpu.dev": "gpu",
    "mig.flexgpu.dev": "mig",
    "shared-gpu.flexgpu.dev": "shared",
}


def stamp(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def device_classes() -> list[dict[str, Any]]:
    return [
        {
            "metadata": {"name": name},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{DRIVER_NAME}" && {A}.type == "{t}"'
                        }
                    }
                ]
            },
        }
        for name, t in CLASSES.items()
    ]


@cache
def _devices(topology: str, shared: tuple[int, ...]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        backend = SimulatedBackend(load_topology(topology), "n", Path(folder) / "s.json")
        return render_node_gpus(backend.list_gpus(), shared=set(shared))


def node_slices(
    node: str, topology: str, *, shared: tuple[int, ...] = (), taint: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    devices = [dict(d) for d in _devices(topology, shared)]
    if taint is not None:
        devices = [{**d, "taints": [taint]} for d in devices]
    return [
        {"metadata": {"name": f"{node}-{i}"}, "spec": spec}
        for i, spec in enumerate(slice_specs(node, devices, 1))
    ]


def node(
    name: str,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = taints
    if unschedulable:
        spec["unschedulable"] = True
    labels = {"kubernetes.io/hostname": name, **(labels or {})}
    return {"metadata": {"name": name, "labels": labels}, "spec": spec}


def request(cls: str = "gpu.flexgpu.dev", count: int = 1, *cel: str, **extra: Any) -> Any:
    body: dict[str, Any] = {"deviceClassName": cls, "count": count, **extra}
    if cel:
        body["selectors"] = [{"cel": {"expression": e}} for e in cel]
    return body


def claim(
    name: str,
    *requests: Any,
    ns: str = "ns",
    constraints: list[Any] | None = None,
    results: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    devices: dict[str, Any] = {
        "requests": [
            {"name": f"r{i}" if i else "gpu", "exactly": r} for i, r in enumerate(requests)
        ]
    }
    if constraints:
        devices["constraints"] = constraints
    body: dict[str, Any] = {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "creationTimestamp": stamp(60),
        },
        "spec": {"devices": devices},
    }
    if results is not None:
        body["status"] = {"allocation": {"devices": {"results": results}}}
    return body


def holding(name: str, pool: str, *devices: str, ns: str = "ns", **consumed: str) -> dict[str, Any]:
    """A claim already allocated the given devices (with consumed capacity for shares)."""
    results = []
    for i, dev in enumerate(devices):
        result: dict[str, Any] = {
            "request": "gpu",
            "driver": DRIVER_NAME,
            "pool": pool,
            "device": dev,
        }
        if consumed:
            result["shareID"] = f"share-{name}-{i}"
            result["consumedCapacity"] = consumed
        results.append(result)
    return claim(name, request(), ns=ns, results=results)


def pod(
    name: str,
    *claims: str,
    ns: str = "ns",
    age_s: float = 60,
    node_name: str = "",
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict[str, str]] | None = None,
    affinity: list[dict[str, Any]] | None = None,
    templates: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
    }
    statuses = []
    for entry, generated in (templates or {}).items():
        spec["resourceClaims"].append({"name": entry, "resourceClaimTemplateName": "t"})
        if generated:
            statuses.append({"name": entry, "resourceClaimName": generated})
    if node_name:
        spec["nodeName"] = node_name
    if node_selector:
        spec["nodeSelector"] = node_selector
    if tolerations:
        spec["tolerations"] = tolerations
    if affinity is not None:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": affinity}
            }
        }
    return {
        "metadata": {
            "name": name,
            "namespace": ns,
            "uid": f"uid-{name}",
            "creationTimestamp": stamp(age_s),
        },
        "spec": spec,
        "status": {"phase": "Pending", "resourceClaimStatuses": statuses},
    }


def load(state: ClusterState, **objects: list[dict[str, Any]]) -> Snapshot:
    """``state`` with its content replaced by the given objects (``classes`` default to ours);
    every call is a new revision, as a watch event would be."""
    objects.setdefault("classes", device_classes())
    kinds: tuple[Kind, ...] = ("slices", "classes", "claims", "nodes", "pods", "policies")
    for kind in kinds:
        state.replace(kind, objects.get(kind, []))
    return state.snapshot()


def snapshot(**objects: list[dict[str, Any]]) -> Snapshot:
    """A fresh state holding the given objects."""
    return load(ClusterState(), **objects)
